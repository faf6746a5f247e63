//! The watcher's wire format, one question and its answers per connection:
//!
//! ```text
//! question:  b"KILNWATCH1\n"  u32 count
//!            count × ( u32 length, canonical path bytes, u8 has-Dockerfile, [u32 length, bytes] )
//! answer:    b"KILNWATCH1\n"  count × ( u8 kind, u32 length, bytes )
//!            kind 0: the tag (opaque); kind 1: why the path cannot be watched (UTF-8)
//! ```
//! Little-endian. A version of `kiln` that speaks another format gets a closed connection, and
//! walks.

use std::io::{self, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use super::Context;

const HELLO: &[u8; 11] = b"KILNWATCH1\n";
/// No question names more contexts than this, and no path or tag is longer: a bound on what one
/// connection can make the watcher allocate.
pub const MAX_COUNT: u32 = 4096;
const MAX_LEN: u32 = 64 << 10;

pub fn write_question(out: &mut impl Write, contexts: &[Context]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(64 * contexts.len() + 16);
    buf.extend_from_slice(HELLO);
    buf.extend_from_slice(&(contexts.len() as u32).to_le_bytes());
    for (root, dockerfile) in contexts {
        let bytes = root.as_os_str().as_bytes();
        buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        buf.extend_from_slice(bytes);
        match dockerfile {
            Some(name) => {
                buf.push(1);
                buf.extend_from_slice(&(name.len() as u32).to_le_bytes());
                buf.extend_from_slice(name.as_bytes());
            }
            None => buf.push(0),
        }
    }
    out.write_all(&buf)
}

pub fn read_question(input: &mut impl Read) -> io::Result<Vec<Context>> {
    hello(input)?;
    let count = u32_of(input)?;
    if count > MAX_COUNT {
        return Err(invalid("too many paths in one question"));
    }
    (0..count)
        .map(|_| {
            let root = PathBuf::from(std::ffi::OsString::from_vec(bytes_of(input)?));
            let mut has = [0u8; 1];
            input.read_exact(&mut has)?;
            let dockerfile = match has[0] {
                0 => None,
                1 => Some(String::from_utf8(bytes_of(input)?).map_err(|_| invalid("a Dockerfile path not UTF-8"))?),
                _ => return Err(invalid("a Dockerfile flag other than 0 or 1")),
            };
            Ok((root, dockerfile))
        })
        .collect()
}

pub fn write_answers(out: &mut impl Write, answers: &[Result<Vec<u8>, String>]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(48 * answers.len() + 16);
    buf.extend_from_slice(HELLO);
    for answer in answers {
        let (kind, bytes) = match answer {
            Ok(tag) => (0u8, tag.as_slice()),
            Err(why) => (1u8, why.as_bytes()),
        };
        buf.push(kind);
        buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        buf.extend_from_slice(bytes);
    }
    out.write_all(&buf)
}

pub fn read_answers(input: &mut impl Read, count: usize) -> io::Result<Vec<Result<Vec<u8>, String>>> {
    hello(input)?;
    (0..count)
        .map(|_| {
            let mut kind = [0u8; 1];
            input.read_exact(&mut kind)?;
            let bytes = bytes_of(input)?;
            match kind[0] {
                0 => Ok(Ok(bytes)),
                1 => Ok(Err(String::from_utf8_lossy(&bytes).into_owned())),
                _ => Err(invalid("unknown answer kind")),
            }
        })
        .collect()
}

fn hello(input: &mut impl Read) -> io::Result<()> {
    let mut got = [0u8; HELLO.len()];
    input.read_exact(&mut got)?;
    match &got == HELLO {
        true => Ok(()),
        false => Err(invalid("not a kiln watcher of this version")),
    }
}

fn u32_of(input: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    input.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn bytes_of(input: &mut impl Read) -> io::Result<Vec<u8>> {
    let len = u32_of(input)?;
    if len > MAX_LEN {
        return Err(invalid("a path or tag longer than 64 KiB"));
    }
    let mut bytes = vec![0u8; len as usize];
    input.read_exact(&mut bytes)?;
    Ok(bytes)
}

fn invalid(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_question_and_its_answers_read_back() {
        let roots = vec![
            (PathBuf::from("/a/b"), Some("build/Dockerfile".to_string())),
            (PathBuf::from(std::ffi::OsString::from_vec(b"/caf\xe9".to_vec())), None),
        ];
        let mut wire = Vec::new();
        write_question(&mut wire, &roots).unwrap();
        assert_eq!(read_question(&mut wire.as_slice()).unwrap(), roots);
        let answers = vec![Ok(b"w:1".to_vec()), Err("not a directory".to_string())];
        let mut wire = Vec::new();
        write_answers(&mut wire, &answers).unwrap();
        assert_eq!(read_answers(&mut wire.as_slice(), 2).unwrap(), answers);
    }

    #[test]
    fn another_format_or_a_lying_length_is_refused() {
        assert!(read_question(&mut &b"KILNWATCH2\n\0\0\0\0"[..]).is_err());
        let mut wire = HELLO.to_vec();
        wire.extend_from_slice(&(MAX_COUNT + 1).to_le_bytes());
        assert!(read_question(&mut wire.as_slice()).is_err(), "too many");
        let mut wire = HELLO.to_vec();
        wire.extend_from_slice(&1u32.to_le_bytes());
        wire.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_question(&mut wire.as_slice()).is_err(), "a 4 GiB path");
    }
}
