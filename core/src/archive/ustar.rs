//! The few ustar and pax records the canonical archive uses, written field by field so the bytes
//! depend on nothing but the entry: no clock, no user database, no library default.

use crate::digest::EntryKind;
use std::io::{self, Write};

const BLOCK: usize = 512;
/// Largest size ustar's 11 octal digits hold; bigger files get a pax `size` record.
const USTAR_MAX_SIZE: u64 = 0o77777777777;
/// Fixed name of every pax extended header, so the header itself is as canonical as its entry.
const PAX_NAME: &[u8] = b"././@PaxHeader";

/// Writes one entry's header (preceded by a pax record when a name or size does not fit ustar).
pub(super) fn write_header(
    out: &mut impl Write,
    path: &[u8],
    kind: EntryKind,
    size: u64,
    link: &[u8],
) -> io::Result<()> {
    let mut name = path.to_vec();
    if kind == EntryKind::Dir {
        name.push(b'/');
    }
    let mut pax = Vec::new();
    if name.len() > 100 {
        pax_record(&mut pax, "path", &name);
    }
    if link.len() > 100 {
        pax_record(&mut pax, "linkpath", link);
    }
    if size > USTAR_MAX_SIZE {
        pax_record(&mut pax, "size", size.to_string().as_bytes());
    }
    if !pax.is_empty() {
        let header = header(PAX_NAME, b'x', 0o644, pax.len() as u64, b"");
        out.write_all(&header)?;
        out.write_all(&pax)?;
        write_padding(out, pax.len() as u64)?;
    }
    let (flag, mode) = match kind {
        EntryKind::Dir => (b'5', 0o755),
        EntryKind::File => (b'0', 0o644),
        EntryKind::ExecFile => (b'0', 0o755),
        EntryKind::Symlink => (b'2', 0o777),
    };
    // Truncated fields are what readers that ignore pax would see; pax-aware readers (ours, the
    // `tar` crate, Docker) take the record above.
    let shown_size = if size > USTAR_MAX_SIZE { 0 } else { size };
    out.write_all(&header(&name[..name.len().min(100)], flag, mode, shown_size, &link[..link.len().min(100)]))
}

/// Zero bytes that round `len` up to a whole block.
pub(super) fn write_padding(out: &mut impl Write, len: u64) -> io::Result<()> {
    let rem = (len % BLOCK as u64) as usize;
    if rem != 0 {
        out.write_all(&[0u8; BLOCK][..BLOCK - rem])?;
    }
    Ok(())
}

/// The two zero blocks that end a tar stream.
pub(super) fn write_end(out: &mut impl Write) -> io::Result<()> {
    out.write_all(&[0u8; 2 * BLOCK])
}

fn header(name: &[u8], flag: u8, mode: u32, size: u64, link: &[u8]) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], mode as u64);
    octal(&mut h[108..116], 0); // uid
    octal(&mut h[116..124], 0); // gid
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 0); // mtime
    h[156] = flag;
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // uname/gname stay empty; devmajor/devminor are zero fields.
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| b as u32).sum();
    let digits = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(digits.as_bytes());
    h
}

/// Zero-padded octal filling the field but its last byte, which is NUL.
fn octal(field: &mut [u8], value: u64) {
    let width = field.len() - 1;
    let digits = format!("{value:0width$o}");
    field[..width].copy_from_slice(digits.as_bytes());
    field[width] = 0;
}

/// One pax record: `<len> <key>=<value>\n`, where `<len>` counts the whole record, itself included.
fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let body = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    out.extend_from_slice(format!("{len} {key}=").as_bytes());
    out.extend_from_slice(value);
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_record_length_counts_itself() {
        for n in [1usize, 5, 90, 95, 96, 97, 990, 995, 996] {
            let mut out = Vec::new();
            pax_record(&mut out, "path", &vec![b'a'; n]);
            let (len, _) = std::str::from_utf8(&out[..out.iter().position(|&b| b == b' ').unwrap()])
                .map(|s| (s.parse::<usize>().unwrap(), ()))
                .unwrap();
            assert_eq!(len, out.len(), "value of {n} bytes");
        }
    }

    #[test]
    fn header_checksum_is_valid_and_fields_are_zero() {
        let h = header(b"a/b.txt", b'0', 0o644, 12, b"");
        let stored = u32::from_str_radix(std::str::from_utf8(&h[148..154]).unwrap(), 8).unwrap();
        let mut copy = h;
        copy[148..156].fill(b' ');
        assert_eq!(stored, copy.iter().map(|&b| b as u32).sum::<u32>());
        assert_eq!(&h[136..148], b"00000000000\0", "mtime is zero");
        assert!(h[265..329].iter().all(|&b| b == 0), "no user or group names");
    }
}
