//! `kiln-e2e`: the harness for end-to-end tests against real Docker, a real registry and real
//! containerd (../shared/COMPONENTS.md says how each starts). The tests themselves arrive with the
//! converge issue; the pure core is tested in `core/tests`.
