// Baseline (b) for `kiln-bench digest`: the tree hash as the seed's `contentHash` computed it —
// sha256 over `index:relpath\n` + content for every regular file, directories walked in sorted
// order, each `readdir` and `readFile` awaited one at a time. Symlinks and other types are skipped,
// as there. Prints `<hex12> <milliseconds>`; the time covers the hash only, not Node's start-up,
// so the comparison is with a warm process as the seed ran it.
//
// usage: node content_hash.mjs DIR [SALT]
import { createHash } from "node:crypto";
import { readdir, readFile, stat } from "node:fs/promises";
import { basename, join, relative } from "node:path";

async function treeHash(paths, salt) {
  const hash = createHash("sha256");
  hash.update(`salt:${salt}\n`);

  async function visit(root, dir, index) {
    const names = await readdir(dir, { withFileTypes: true });
    names.sort((x, y) => x.name.localeCompare(y.name));
    for (const dirent of names) {
      const full = join(dir, dirent.name);
      if (dirent.isDirectory()) {
        await visit(root, full, index);
      } else if (dirent.isFile()) {
        hash.update(`${index}:${relative(root, full)}\n`);
        hash.update(await readFile(full));
      }
    }
  }

  for (let index = 0; index < paths.length; index++) {
    const p = paths[index];
    if ((await stat(p)).isDirectory()) {
      await visit(p, p, index);
    } else {
      hash.update(`${index}:${basename(p)}\n`);
      hash.update(await readFile(p));
    }
  }
  return hash.digest("hex").slice(0, 12);
}

const [dir, salt = "kiln-bench"] = process.argv.slice(2);
if (!dir) {
  console.error("usage: node content_hash.mjs DIR [SALT]");
  process.exit(2);
}
const started = process.hrtime.bigint();
const digest = await treeHash([dir], salt);
const ms = Number(process.hrtime.bigint() - started) / 1e6;
console.log(`${digest} ${ms.toFixed(3)}`);
