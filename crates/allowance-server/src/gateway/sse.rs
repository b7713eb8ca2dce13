//! Server-sent events as they arrive: whole events cut out of a byte
//! stream, their raw bytes kept so the gateway forwards them unchanged.

use bytes::{Bytes, BytesMut};

/// The most a single event may take before the stream is considered
/// broken (a provider's events are a few KiB; this bounds memory).
pub(crate) const MAX_EVENT_BYTES: usize = 4 << 20;

/// One event: its raw bytes (terminator included) and its parsed fields.
#[derive(Debug)]
pub(crate) struct RawEvent {
    pub raw: Bytes,
    /// The `event:` line.
    pub name: Option<String>,
    /// The `data:` lines, joined by `\n`.
    pub data: String,
}

/// Cuts events out of chunks.
#[derive(Default)]
pub(crate) struct Splitter {
    buf: BytesMut,
    /// Bytes of `buf` already searched for a terminator.
    scanned: usize,
}

impl Splitter {
    /// Adds a chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Whether an unfinished event has grown past [`MAX_EVENT_BYTES`].
    pub fn overflowed(&self) -> bool {
        self.buf.len() > MAX_EVENT_BYTES
    }

    /// What is left that is not a whole event.
    pub fn rest(&mut self) -> Bytes {
        self.scanned = 0;
        self.buf.split().freeze()
    }

    /// The next whole event, if one has arrived.
    pub fn next_event(&mut self) -> Option<RawEvent> {
        // A terminator is a blank line: "\n\n", "\r\n\r\n" or "\r\r".
        let from = self.scanned.saturating_sub(3);
        let bytes = &self.buf[from..];
        let mut end = None;
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'\n' if bytes.get(i + 1) == Some(&b'\n') => {
                    end = Some(from + i + 2);
                    break;
                }
                b'\r'
                    if bytes.get(i + 1) == Some(&b'\n')
                        && bytes.get(i + 2) == Some(&b'\r')
                        && bytes.get(i + 3) == Some(&b'\n') =>
                {
                    end = Some(from + i + 4);
                    break;
                }
                b'\r' if bytes.get(i + 1) == Some(&b'\r') => {
                    end = Some(from + i + 2);
                    break;
                }
                _ => i += 1,
            }
        }
        let Some(end) = end else {
            self.scanned = self.buf.len();
            return None;
        };
        let raw = self.buf.split_to(end).freeze();
        self.scanned = 0;
        let (name, data) = parse_fields(&raw);
        Some(RawEvent { raw, name, data })
    }
}

fn parse_fields(raw: &[u8]) -> (Option<String>, String) {
    let text = String::from_utf8_lossy(raw);
    let mut name = None;
    let mut data: Option<String> = None;
    for line in text.split(['\n', '\r']) {
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => name = Some(value.to_string()),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            _ => {}
        }
    }
    (name, data.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_come_out_whole() {
        let stream = b"event: message_start\ndata: {\"a\":1}\n\ndata: {\"b\":\ndata: 2}\r\n\r\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut s = Splitter::default();
            let mut got = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                s.push(part);
                while let Some(e) = s.next_event() {
                    got.push(e);
                }
            }
            assert_eq!(got.len(), 3, "cut at {cut}");
            assert_eq!(got[0].name.as_deref(), Some("message_start"));
            assert_eq!(got[0].data, "{\"a\":1}");
            assert_eq!(got[1].data, "{\"b\":\n2}");
            assert_eq!(got[2].data, "[DONE]");
            let raw: Vec<u8> = got.iter().flat_map(|e| e.raw.to_vec()).collect();
            assert_eq!(raw, stream.to_vec(), "bytes pass unchanged");
        }
    }

    #[test]
    fn an_unfinished_event_waits() {
        let mut s = Splitter::default();
        s.push(b"data: {\"partial\"");
        assert!(s.next_event().is_none());
        assert_eq!(&s.rest()[..], b"data: {\"partial\"");
    }
}
