//! Property tests for reading `FROM` images out of a Dockerfile: the coordinator reads Dockerfiles a
//! client sent (`ImageSpec.dockerfile_outside`), so the reader must hold on any text, and the CLI
//! rewrites what it found, so a rewrite must change those images and nothing else.
//!
//! Texts are drawn from the pieces of Dockerfile syntax the reader treats specially (keywords,
//! flags, `AS`, both escape characters and the directive choosing them, comments, blank and CRLF
//! lines, heredocs, variables, multi-byte characters), so most cases hold several `FROM`s.

use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_core::dockerfile::{from_images, rewrite};
use proptest::prelude::*;

const PIECES: &[&str] = &[
    "FROM ",
    "from ",
    "RUN ",
    "COPY ",
    "AS ",
    "as ",
    "base",
    "shop-base",
    "tools",
    "x:1",
    "$B",
    "${B}",
    "scratch",
    "--platform=linux/amd64 ",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\\",
    "`",
    "\\\n",
    "# c\n",
    "# escape=`\n",
    "<<EOF",
    "<<-EOF",
    "EOF\n",
    "\tEOF\n",
    "é",
    "ü ",
    "\n\n",
    "\nFROM ",
    "\nFROM base AS tools\n",
    "\nFROM shop-base\n",
];

fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(proptest::sample::select(PIECES), 0..40).prop_map(|pieces| pieces.concat())
}

static WITH_FROMS: AtomicUsize = AtomicUsize::new(0);
static CASES: AtomicUsize = AtomicUsize::new(0);

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Every image found lies at its span (with continuations dropped), and replacing every span
    /// yields a text whose FROM images are exactly the replacements, on the same FROMs.
    #[test]
    fn a_rewrite_replaces_exactly_the_images_found(text in text()) {
        let found = from_images(&text);
        CASES.fetch_add(1, Ordering::Relaxed);
        if !found.is_empty() {
            WITH_FROMS.fetch_add(1, Ordering::Relaxed);
        }
        for image in &found {
            // Slicing panics off a character boundary: the span is a real place in the text.
            let at = &text[image.span.clone()];
            prop_assert!(at.starts_with(image.image.chars().next().unwrap()), "{at:?} for {image:?}");
            prop_assert!(at.ends_with(image.image.chars().last().unwrap()), "{at:?} for {image:?}");
        }
        let replacement = "kiln-rewritten:0123456789ab-amd64";
        let spans: Vec<_> = found.iter().map(|f| (f.span.clone(), replacement.to_string())).collect();
        let rewritten = rewrite(&text, &spans);
        let again = from_images(&rewritten);
        prop_assert_eq!(again.len(), found.len(), "{:?} → {:?}", text, rewritten);
        prop_assert!(again.iter().all(|f| f.image == replacement), "{:?}", again);
    }
}

#[test]
fn the_generated_texts_hold_froms() {
    a_rewrite_replaces_exactly_the_images_found();
    let (with, all) = (WITH_FROMS.load(Ordering::Relaxed), CASES.load(Ordering::Relaxed));
    assert!(with * 2 >= all, "only {with} of {all} cases found a FROM image");
}
