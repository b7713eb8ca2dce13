//! Response bodies sent piece by piece as they are produced, so a client
//! sees each SSE event when it is made, and a scripted cut can drop the
//! connection mid-body.

use std::io;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use serde_json::Value;

use crate::control::InFlight;

/// One piece of a response body.
#[derive(Debug, Clone)]
pub(crate) enum Piece {
    /// Bytes sent at once.
    Event(Bytes),
    /// Bytes carrying one output token, sent after the token delay.
    Token(Bytes),
    /// Drop the connection here.
    Cut,
}

/// `data: {json}\n\n`, OpenAI chat's framing.
pub(crate) fn data_event(value: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    write_json(&mut out, value);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// `event: {name}\ndata: {json}\n\n`, the Responses API's and Anthropic's
/// framing.
pub(crate) fn named_event(name: &str, value: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    write_json(&mut out, value);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn write_json(out: &mut Vec<u8>, value: &Value) {
    // Writing a `Value` into a Vec cannot fail.
    let _ = serde_json::to_writer(out, value);
}

/// A stream's events: those before the output, one per output token, and
/// those after it (end of output, usage).
#[derive(Debug, Default)]
pub(crate) struct Events {
    pub(crate) head: Vec<Bytes>,
    pub(crate) tokens: Vec<Bytes>,
    pub(crate) tail: Vec<Bytes>,
}

impl Events {
    /// The pieces to send; with `cut_after_tokens`, the head and at most
    /// that many tokens, then the connection drops (no tail, so no usage).
    pub(crate) fn into_pieces(self, cut_after_tokens: Option<u64>) -> Vec<Piece> {
        let mut pieces =
            Vec::with_capacity(self.head.len() + self.tokens.len() + self.tail.len() + 1);
        pieces.extend(self.head.into_iter().map(Piece::Event));
        match cut_after_tokens {
            Some(cut) => {
                let kept = usize::try_from(cut).unwrap_or(usize::MAX);
                pieces.extend(self.tokens.into_iter().take(kept).map(Piece::Token));
                pieces.push(Piece::Cut);
            }
            None => {
                pieces.extend(self.tokens.into_iter().map(Piece::Token));
                pieces.extend(self.tail.into_iter().map(Piece::Event));
            }
        }
        pieces
    }
}

/// Long enough for hyper to write out what precedes a cut.
const CUT_FLUSH_PAUSE: Duration = Duration::from_millis(20);

struct Producer {
    pieces: std::vec::IntoIter<Piece>,
    token_delay: Duration,
    // Counts the call in flight until the body is done or the client leaves.
    _in_flight: Option<InFlight>,
}

/// A body that yields `pieces` in order, pausing `token_delay` before each
/// token.
pub(crate) fn streamed(
    pieces: Vec<Piece>,
    token_delay: Duration,
    in_flight: Option<InFlight>,
) -> Body {
    let producer = Producer {
        pieces: pieces.into_iter(),
        token_delay,
        _in_flight: in_flight,
    };
    Body::from_stream(futures_util::stream::unfold(
        producer,
        |mut producer| async move {
            let bytes = match producer.pieces.next()? {
                Piece::Event(bytes) => bytes,
                Piece::Token(bytes) => {
                    if !producer.token_delay.is_zero() {
                        tokio::time::sleep(producer.token_delay).await;
                    }
                    bytes
                }
                Piece::Cut => {
                    // hyper aborts the connection on a body error, dropping what
                    // it has not written yet; pausing first lets it flush, so the
                    // client gets every piece before the cut, as when an upstream
                    // dies mid-answer.
                    tokio::time::sleep(CUT_FLUSH_PAUSE).await;
                    producer.pieces = Vec::new().into_iter();
                    return Some((
                        Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "scripted cut",
                        )),
                        producer,
                    ));
                }
            };
            Some((Ok::<Bytes, io::Error>(bytes), producer))
        },
    ))
}
