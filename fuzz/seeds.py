#!/usr/bin/env python3
"""Writes the seed inputs of every fuzz target into fuzz/seeds/<target>/ (FUZZING.md "Corpora").

The seeds are the existing tests' inputs: refs and platforms from core/tests/refs.rs and the
sweep's normalization tests, .dockerignore files and paths from core/src/ignore's tests, the
shipped examples' kiln.toml files and the manifest tests' cases, archives shaped like
core/tests/archive.rs's sample tree and every hostile-archive case there, UpRequests like the
coordinator's, and BuildKit answers captured from a Docker daemon (20.10, API 1.41) with
`curl --unix-socket /var/run/docker.sock -X POST .../build?version=2` and committed as
fuzz/captures/*.answer: a build, a failed step, a refused request.

Run from anywhere; then `cargo fuzz cmin <target> fuzz/seeds/<target>` folds them into the corpus.
"""

import io
import os
import struct
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEX = "4a77b1c2d3e4f5061728394a5b6c7d8e9f00112233445566778899aabbccddee"
D = "sha256:7031c1b283388d2c2e09b57badb803c05ebed362dc88d84b480cc47f72a21097"


def write(target, name, data):
    folder = os.path.join(HERE, "seeds", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def refs():
    inputs = [
        "x", "x:1", "library/x", "docker.io/library/x:2", "index.docker.io/team/y", "team/y:t",
        "localhost:5000/a/b:c", "reg.example.com/library/x", "[::1]:5000/x:y", "Registry.Example/x",
        f"envoyproxy/envoy:v1@sha256:{HEX}", f"import-2026-11-29@sha256:{HEX}", f"sha256:{HEX}",
        f"import-tool@sha256:{HEX}", f"docker.io/library/import-2026-11-29@sha256:{HEX}",
        f"x@sha512:{'a' * 128}", "a..b", "x/a___b:1", "a//b", "x:", "reg.io:50a/x", "a" * 237,
        f"reg.io/a:1@{D}", "a:/b", "linux/amd64", "arm64/v8", "windows/amd64", "linux/arm/v7",
        "x86_64", "aarch64", "linux/arm64/v8", "amd64/v1",
    ]
    for i, text in enumerate(inputs):
        write("refs", f"seed-{i:02}", text)


def dockerignore():
    cases = [
        ("*.md", ["README.md", "docs/a.md"]),
        ("**/*.md", ["README.md", "docs/deep/er/a.md", "docs/a.mdx"]),
        ("docs", ["docs", "docs/a/b", "docsx", "x/docs"]),
        ("docs/**", ["docs/a", "docs"]),
        ("docs\n!docs/keep.md\n", ["docs/keep.md", "docs/other.md"]),
        ("*.log\n!keep.log\nkeep.log\n", ["keep.log", "other.log"]),
        ("docs\n!*/keep\n", ["docs/keep"]),
        ("/foo\n./foo/../bar\na//b/./c/\n", ["foo", "bar", "a/b/c"]),
        ("#x\n #x\n", ["#x"]),
        ("\ufeffa.txt\r\n\n   \n  b.txt  \n!  b.txt\n", ["a.txt", "b.txt"]),
        ("[a-c].txt\n[^a-c].txt\nx[[]\n", ["a.txt", "d.txt", "x["]),
        ("\\*.txt\na\\?\n", ["*.txt", "a?", "ab"]),
        ("a.b+(c)|{d}$\na.*\n", ["a.b+(c)|{d}$", "a.txt"]),
        ("a?c\na/**/b\n", ["abc", "a/c", "a/x/y/b"]),
        ("**/foo\n**foo\n**\n", ["foo", "a/b/foo", "barfoo"]),
        ("a\n\n!\n", ["a"]),
        ("ok\n[a-\n", ["ok"]),
        ("[\\]]\na*[*]\n[a-z]*\n!a\n", ["]", "a*", "q"]),
        ("/ a\n!/ b\n", ["a", " a", "b"]),
        ("x\\d\n", ["x5", "xd"]),
    ]
    for i, (text, paths) in enumerate(cases):
        write("dockerignore", f"seed-{i:02}", "\0".join([text] + paths))


def manifest():
    for example in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        path = os.path.join(ROOT, "examples", example, "kiln.toml")
        if os.path.exists(path):
            write("manifest", f"example-{example}", open(path, "rb").read())
    full = f'''instance = "shop"
platforms = ["linux/arm64", "linux/amd64"]

[target]
kind = "registry"
registry = "127.0.0.1:5000/team"
namespace = "shop"
mirror_registry = "mirror.internal:5000/upstream"

[built.api]
context = "api"
args = {{ VERSION = "1" }}
target = "runtime"
shared = false
repository = "shop-api"

[built.web]
context = "web"
dockerfile = "web/docker/web.Dockerfile"

[brought.db]
ref = "postgres:16"

[pinned.envoy]
ref = "envoyproxy/envoy:v1.30.1@{D}"
'''
    write("manifest", "full", full)
    broken = [
        'instance = "shop"\n[target]\nkind = "registry"\n[built.api]\ncontxt = "api"\n',
        'instance = "Shop"\n[target]\nkind = "local"\n[brought.db]\nref = "postgres"\n',
        'instance = "shop"\n[target]\nkind = "nodes"\n[pinned.p]\nref = "x:1"\n',
        'instance = "shop"\n[target]\nkind = "kind"\ncluster = "kind"\n[built.a]\ncontext = "notadir"\n',
        'instance = "shop"\n[target]\nkind = "local"\n[built.a]\ncontext = "api-link"\ndockerfile = "../x"\n',
        'instance = "shop"\ninstance = "x"\n',
        'instance = "shop"\nplatforms = []\n[target]\nkind = "local"\n',
        '[target]\nkind = "registry"\nregistry = "team"\n',
    ]
    for i, text in enumerate(broken):
        write("manifest", f"broken-{i:02}", text)


def tar_bytes(build, fmt=tarfile.USTAR_FORMAT):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        build(tar)
    return out.getvalue()


def add(tar, name, kind=tarfile.REGTYPE, data=b"", link="", mode=0o644):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def archives():
    def sample(tar):
        add(tar, "Dockerfile", data=b"FROM scratch\nCOPY . /\n")
        long_dir = "d" * 60
        add(tar, long_dir + "/", tarfile.DIRTYPE, mode=0o755)
        add(tar, long_dir + "/" + "f" * 70, data=b"\x07" * 1500)
        add(tar, long_dir + "/longlink", tarfile.SYMTYPE, link="../" + "x" * 120, mode=0o777)
        add(tar, "empty/", tarfile.DIRTYPE, mode=0o755)
        add(tar, "src/", tarfile.DIRTYPE, mode=0o755)
        add(tar, "src/deep/", tarfile.DIRTYPE, mode=0o755)
        add(tar, "src/deep/link", tarfile.SYMTYPE, link="../main.txt", mode=0o777)
        add(tar, "src/deep/run.sh", data=b"#!/bin/sh\necho hi\n", mode=0o755)
        add(tar, "src/main.txt", data=b"hello")

    write("archive_unpack", "sample-pax", tar_bytes(sample, tarfile.PAX_FORMAT))
    write("archive_unpack", "sample-gnu", tar_bytes(sample, tarfile.GNU_FORMAT))
    write("archive_unpack", "empty", b"\0" * 1024)
    hostile = {
        "absolute": lambda t: add(t, "/tmp/kiln-fuzz-evil", data=b"x"),
        "dot-dot": lambda t: add(t, "a/../../evil", data=b"x"),
        "link-out": lambda t: add(t, "link", tarfile.SYMTYPE, link="../outside"),
        "link-absolute": lambda t: add(t, "link", tarfile.SYMTYPE, link="/etc"),
        "through-link": lambda t: (add(t, "real/", tarfile.DIRTYPE), add(t, "sub", tarfile.SYMTYPE, link="real"),
                                   add(t, "sub/x", data=b"through the link")),
        "hardlink": lambda t: (add(t, "a", data=b"x"), add(t, "b", tarfile.LNKTYPE, link="a")),
        "device": lambda t: add(t, "dev", tarfile.CHRTYPE),
        "fifo": lambda t: add(t, "p", tarfile.FIFOTYPE),
        "reordered": lambda t: (add(t, "b", data=b"1"), add(t, "a", data=b"2")),
        "repeated": lambda t: (add(t, "a", data=b"1"), add(t, "a", data=b"2")),
        "file-under-file": lambda t: (add(t, "a", data=b"1"), add(t, "a/b", data=b"2")),
    }
    for name, build in hostile.items():
        write("archive_unpack", f"hostile-{name}", tar_bytes(build))
    # pax records rewriting an innocent name out of the root.
    for name, path in [("pax-dot-dot", "../../evil"), ("pax-absolute", "/tmp/evil-kiln")]:
        write("archive_unpack", f"hostile-{name}",
              tar_bytes(lambda t, p=path: t.addfile(pax_file(p), io.BytesIO(b"x")), tarfile.PAX_FORMAT))
    write("archive_unpack", "short-content", tar_bytes(lambda t: add(t, "a", data=b"x" * 600))[:1024])


def pax_file(path):
    info = tarfile.TarInfo("innocent")
    info.size = 1
    info.mtime = 0
    info.pax_headers = {"path": path}
    return info


def roundtrip():
    # Arbitrary's bytes: a few shapes so the first runs already build trees.
    for i, data in enumerate([bytes(range(64)), bytes(range(255, 0, -3)), b"\x01\x02\x00\x05" * 40]):
        write("archive_roundtrip", f"seed-{i}", data)


def varint(n):
    out = b""
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


def field(number, value):
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    if isinstance(value, str):
        value = value.encode()
    return varint(number << 3 | 2) + varint(len(value)) + value


def up_requests():
    digest = "ab" * 32

    def image(name, kind, reference, context="", dockerfile="", outside=b"", args=()):
        body = field(1, name) + field(2, kind) + field(3, reference)
        if context:
            body += field(4, context)
        if dockerfile:
            body += field(5, dockerfile)
        if outside:
            body += field(6, outside)
        for k, v in args:
            body += field(7, field(1, k) + field(2, v))
        return body

    def request(instance="shop", target=(4, "", "", "shop"), platforms=("linux/amd64",), images=()):
        body = field(1, instance) if instance else b""
        if target is not None:
            kind, registry, cluster, namespace = target
            t = field(1, kind) + (field(2, registry) if registry else b"") + (field(3, cluster) if cluster else b"")
            body += field(2, t + (field(4, namespace) if namespace else b""))
        for p in platforms:
            body += field(3, p)
        for i in images:
            body += field(4, i)
        return body + field(5, 1) + field(6, "me@host")

    built = image("api", 1, "shop-api:abc", context=digest, dockerfile="Dockerfile", args=[("V", "1")])
    cases = {
        "local": request(images=[built]),
        "registry": request(target=(1, "127.0.0.1:5000/team", "", ""), images=[built, image("db", 2, "postgres:16")]),
        "kind": request(target=(2, "", "kind", ""), images=[image("p", 3, f"envoy:v1@{D}")]),
        "nodes": request(target=(3, "", "edge", "ns"), images=[image("w", 1, "w:1", context="blake3:" + digest,
                                                                       outside=b"FROM scratch\n")]),
        "no-target": request(target=None),
        "no-registry": request(target=(1, "", "", "")),
        "no-platforms": request(platforms=()),
        "bad-digest": request(images=[image("api", 1, "x:1", context="zz")]),
        "no-dockerfile": request(images=[image("api", 1, "x:1", context=digest)]),
        "bad-ref": request(images=[image("api", 2, "UPPER")]),
        "unspecified": request(images=[image("api", 0, "x")]),
        "no-instance": request(instance=""),
    }
    for name, data in cases.items():
        write("up_request", name, data)


def buildkit_records():
    # Odd first byte: StatusResponse records behind a 2-byte little-endian length.
    def vertex(digest, name, started=True, error="", completed=False, cached=False):
        body = field(1, digest) + field(3, name)
        if cached:
            body += field(4, 1)
        if started:
            body += field(5, field(1, 1))
        if completed:
            body += field(6, field(1, 2))
        if error:
            body += field(7, error)
        return field(1, body)

    def log(digest, msg):
        return field(3, field(1, digest) + field(4, msg))

    records = [
        vertex("d1", "[1/2] FROM base"),
        vertex("d2", "[2/2] RUN make") + log("d2", b"compil"),
        vertex("d2", "[2/2] RUN make", error="exit code: 2") + log("d2", b"ing\nfailed\n"),
        vertex("d3", "[3/3] COPY a /a", cached=True, completed=True) + log("d3", b"\rprogress 10%\rprogress"),
    ]
    data = b"\x01" + b"".join(struct.pack("<H", len(r)) + r for r in records) + b"\x00"
    write("buildkit_status", "records", data)
    for name in sorted(os.listdir(os.path.join(HERE, "captures"))):
        write("buildkit_status", f"capture-{name}", b"\x00" + open(os.path.join(HERE, "captures", name), "rb").read())
    write("buildkit_status", "error-line", b"\x00HTTP/1.0 200 OK\r\n\r\n"
          b'{"stream":"Step 1/2"}\n{"error":"executor failed running [make]: exit code: 2"}\n')


if __name__ == "__main__":
    refs()
    dockerignore()
    manifest()
    archives()
    roundtrip()
    up_requests()
    buildkit_records()
