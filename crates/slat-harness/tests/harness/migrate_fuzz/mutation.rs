//! Mutations of a valid stream, at the frame level and at the byte level.

use super::*;

#[derive(Debug, Clone)]
pub(crate) enum Mutation {
    /// Change one payload byte of a frame and re-seal it (the parser sees the change).
    Reseal {
        frame: usize,
        at: usize,
        byte: u8,
    },
    Drop {
        frame: usize,
    },
    Duplicate {
        frame: usize,
    },
    Swap {
        a: usize,
        b: usize,
    },
    Insert {
        frame: usize,
        hostile: Hostile,
    },
    Replace {
        frame: usize,
        hostile: Hostile,
    },
    /// Point an entry of a valid batch at another page (sequence and round stay right, so
    /// the destination's index check is what meets it).
    Retarget {
        frame: usize,
        entry: usize,
        page: u64,
    },
    /// Overwrite a byte of an entry's data or length in a valid batch, re-sealed.
    Garble {
        frame: usize,
        entry: usize,
        at: usize,
        byte: u8,
    },
    // Byte level, after the frames are joined.
    Flip {
        at: usize,
        bit: u8,
    },
    Set {
        at: usize,
        byte: u8,
    },
    Truncate {
        at: usize,
    },
    Splice {
        from: usize,
        len: usize,
        to: usize,
    },
}

impl Mutation {
    pub(crate) fn frame_level(&self) -> bool {
        !matches!(
            self,
            Mutation::Flip { .. }
                | Mutation::Set { .. }
                | Mutation::Truncate { .. }
                | Mutation::Splice { .. }
        )
    }
}

pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
    let i = any::<usize>;
    prop_oneof![
        4 => (i(), i(), any::<u8>()).prop_map(|(frame, at, byte)| Mutation::Reseal { frame, at, byte }),
        1 => i().prop_map(|frame| Mutation::Drop { frame }),
        1 => i().prop_map(|frame| Mutation::Duplicate { frame }),
        1 => (i(), i()).prop_map(|(a, b)| Mutation::Swap { a, b }),
        3 => (i(), hostile()).prop_map(|(frame, hostile)| Mutation::Insert { frame, hostile }),
        3 => (i(), hostile()).prop_map(|(frame, hostile)| Mutation::Replace { frame, hostile }),
        3 => (i(), i(), edge_u64()).prop_map(|(frame, entry, page)| Mutation::Retarget { frame, entry, page }),
        2 => (i(), i(), i(), any::<u8>()).prop_map(|(frame, entry, at, byte)| Mutation::Garble { frame, entry, at, byte }),
        1 => (i(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        1 => (i(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => i().prop_map(|at| Mutation::Truncate { at }),
        1 => (i(), 1usize..64, i()).prop_map(|(from, len, to)| Mutation::Splice { from, len, to }),
    ]
}

/// The stream `v` with `muts` applied (frame-level ones first, in order).
pub(crate) fn mutate(v: &ValidStream, muts: &[Mutation]) -> Vec<u8> {
    let mut frames = v.frames.clone();
    for m in muts.iter().filter(|m| m.frame_level()) {
        m.apply_to_frames(&mut frames);
    }
    let mut bytes = v.preamble.clone();
    for f in &frames {
        bytes.extend_from_slice(f);
    }
    for m in muts.iter().filter(|m| !m.frame_level()) {
        m.apply_to_bytes(&mut bytes);
    }
    bytes
}

impl Mutation {
    /// A frame-level mutation, on the stream's frames (others leave them alone).
    pub(crate) fn apply_to_frames(&self, frames: &mut Vec<Vec<u8>>) {
        let n = frames.len().max(1);
        match self {
            Mutation::Reseal { frame, at, byte } => {
                if let Some(f) = frames.get_mut(frame % n) {
                    if f.len() > wire::HEADER {
                        let k = wire::HEADER + at % (f.len() - wire::HEADER);
                        f[k] = *byte;
                        *f = wire::reseal(f);
                    }
                }
            }
            Mutation::Drop { frame } if !frames.is_empty() => {
                frames.remove(frame % n);
            }
            Mutation::Duplicate { frame } => {
                if let Some(f) = frames.get(frame % n).cloned() {
                    frames.insert(frame % n, f);
                }
            }
            Mutation::Swap { a, b } if !frames.is_empty() => frames.swap(a % n, b % n),
            Mutation::Insert { frame, hostile } => frames.insert(frame % (n + 1), hostile.frame()),
            Mutation::Replace { frame, hostile } => {
                if let Some(f) = frames.get_mut(frame % n) {
                    *f = hostile.frame();
                }
            }
            Mutation::Retarget { frame, entry, page } => {
                if let Some((f, e)) = batch_entry(frames, *frame, *entry) {
                    f[e.page..e.page + 8].copy_from_slice(&page.to_le_bytes());
                    *f = wire::reseal(f);
                }
            }
            Mutation::Garble {
                frame,
                entry,
                at,
                byte,
            } => {
                if let Some((f, e)) = batch_entry(frames, *frame, *entry) {
                    // The encoding byte and what follows it.
                    if e.end > e.page + 8 {
                        let k = e.page + 8 + at % (e.end - e.page - 8);
                        f[k] = *byte;
                        *f = wire::reseal(f);
                    }
                }
            }
            _ => {}
        }
    }

    /// A byte-level mutation, on the joined stream (others leave it alone).
    pub(crate) fn apply_to_bytes(&self, bytes: &mut Vec<u8>) {
        let n = bytes.len().max(1);
        match self {
            Mutation::Flip { at, bit } => {
                if let Some(b) = bytes.get_mut(at % n) {
                    *b ^= 1 << bit;
                }
            }
            Mutation::Set { at, byte } => {
                if let Some(b) = bytes.get_mut(at % n) {
                    *b = *byte;
                }
            }
            Mutation::Truncate { at } => bytes.truncate(at % n),
            Mutation::Splice { from, len, to } => {
                let from = from % n;
                let chunk: Vec<u8> = bytes[from..(from + len).min(bytes.len())].to_vec();
                let to = to % (bytes.len() + 1);
                bytes.splice(to..to, chunk);
            }
            _ => {}
        }
    }
}

/// Where an entry of a batch frame lies: its page field, and the end of its bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EntryAt {
    page: usize,
    end: usize,
}

/// The `entry`-th entry (modulo their number) of the first batch frame at or after `frame`
/// (modulo the frame count), found by walking the frame's layout.
pub(crate) fn batch_entry(
    frames: &mut [Vec<u8>],
    frame: usize,
    entry: usize,
) -> Option<(&mut Vec<u8>, EntryAt)> {
    let n = frames.len();
    let k = (0..n)
        .map(|d| (frame % n.max(1) + d) % n)
        .find(|&k| frames[k].first() == Some(&ty::PAGES))?;
    let f = &mut frames[k];
    let mut at = wire::HEADER + 16;
    let mut entries = Vec::new();
    while at + 9 <= f.len() {
        let start = at;
        at += 9;
        match f[start + 8] {
            0 => {}
            1 => at += 4096,
            2 if at + 4 <= f.len() => {
                at += 4 + u32::from_le_bytes([f[at], f[at + 1], f[at + 2], f[at + 3]]) as usize
            }
            _ => return None,
        }
        entries.push(EntryAt {
            page: start,
            end: at.min(f.len()),
        });
    }
    let e = *entries.get(entry % entries.len().max(1))?;
    Some((f, e))
}
