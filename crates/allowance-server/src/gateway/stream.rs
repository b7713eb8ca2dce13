//! A streamed call: events pass through as they arrive (never the whole
//! answer buffered), the hold is topped up a tranche at a time as output
//! flows, and the call settles from the final usage — or, when it ends
//! early (a refused top-up, a client gone, an upstream broken), from the
//! output the gateway saw.

use allowance_core::{Amounts, Dimension, ExtendError, ReservationId, StoreError, Usage};
use allowance_estimate::{Api, PartialUsage};
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::OptionFuture;
use serde_json::Value;
use tokio::sync::mpsc;

use super::answer::{GatewayError, stream_error_event};
use super::call::{
    Counting, Lease, Prepared, UPSTREAM_TIMEOUT, admit_decided, copy_headers, count_call,
    durable_by, estimated_usage, exact_count, ledger_usage, observe_estimate, refund, settle_whole,
};
use super::sse::Splitter;
use super::upstream::Permit;
use crate::AppState;

/// Events in flight between the upstream reader and the client's body:
/// small, so a slow client slows the reader (and the provider) instead of
/// filling memory.
const CHANNEL_EVENTS: usize = 32;

/// How a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The provider finished.
    Complete,
    /// A top-up was refused: the gateway ended it with an error event.
    Cut,
    /// The client went away.
    ClientGone,
    /// The provider's stream broke off or went silent.
    UpstreamBroke,
}

impl End {
    fn label(self) -> &'static str {
        match self {
            End::Complete => "complete",
            End::Cut => "budget",
            End::ClientGone => "client_gone",
            End::UpstreamBroke => "upstream_broke",
        }
    }
}

/// Answers the client at once with the upstream's status and headers, and
/// pumps the events in a task of their own.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    state: AppState,
    p: Prepared,
    tenant_id: ReservationId,
    resp: reqwest::Response,
    attempt_id: Option<ReservationId>,
    permit: Permit,
    lease: Lease,
    extra: HeaderMap,
    counting: Option<Counting>,
) -> Response {
    let status = resp.status();
    let headers = resp.headers().clone();
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(CHANNEL_EVENTS);
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut r = Response::new(Body::from_stream(body));
    *r.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::OK);
    copy_headers(&headers, r.headers_mut());
    r.headers_mut().extend(extra);
    tokio::spawn(pump(
        state, p, tenant_id, resp, attempt_id, permit, lease, tx, counting,
    ));
    r
}

#[allow(clippy::too_many_arguments)]
async fn pump(
    state: AppState,
    mut p: Prepared,
    mut tenant_id: ReservationId,
    resp: reqwest::Response,
    mut attempt_id: Option<ReservationId>,
    permit: Permit,
    mut lease: Lease,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    mut counting: Option<Counting>,
) {
    let mut upstream = resp.bytes_stream();
    let mut split = Splitter::default();
    let mut usage = PartialUsage::default();
    // Every piece of output seen, tokenized once at the end when the
    // provider's usage never came (tokens span events).
    let mut output_text = String::new();
    // A running count, per event, to know when to top up.
    let mut counted: u64 = 0;
    let mut held_output = p.output_reserved;
    let ttl_ms = p.catalog.settings().default_ttl_ms;
    let mut end = End::Complete;
    let mut saw_done = false;
    // The bound's holds, refunded off the stream's path once swapped:
    // waited for before the call settles.
    let mut refunds: Option<tokio::task::JoinHandle<()>> = None;
    // The exact holds being taken, while the events flow on: no top-up
    // runs until they are (a top-up must not land on a hold being swapped).
    let mut swapping: Option<Swapping> = None;
    'read: loop {
        let next = tokio::select! {
            n = tokio::time::timeout(UPSTREAM_TIMEOUT, upstream.next()) => n,
            _ = tx.closed() => { end = End::ClientGone; break 'read; }
            c = OptionFuture::from(counting.as_mut()), if counting.is_some() => {
                counting = None;
                if let Some(Some(n)) = c.map(exact_count) {
                    swapping = start_swap(&state, &mut p, n, attempt_id.is_some(), held_output);
                }
                continue 'read;
            }
            taken = OptionFuture::from(swapping.as_mut()), if swapping.is_some() => {
                swapping = None;
                if let Some(taken) = taken
                    && finish_swap(&state, taken, &mut tenant_id, &mut attempt_id, &mut refunds)
                {
                    lease = Lease::start(&state, &p, tenant_id).and(&state, &p, attempt_id);
                }
                continue 'read;
            }
        };
        let chunk = match next {
            Ok(Some(Ok(c))) => c,
            Ok(None) => {
                if !saw_done {
                    end = End::UpstreamBroke;
                }
                break;
            }
            Ok(Some(Err(_))) | Err(_) => {
                end = End::UpstreamBroke;
                break;
            }
        };
        split.push(&chunk);
        if split.overflowed() {
            end = End::UpstreamBroke;
            break;
        }
        while let Some(ev) = split.next_event() {
            let mut forward = true;
            let mut raw = ev.raw.clone();
            if ev.data == "[DONE]" {
                saw_done = true;
            } else if !ev.data.is_empty()
                && let Ok(v) = serde_json::from_str::<Value>(&ev.data)
            {
                let se = allowance_estimate::read_stream_event(p.api, ev.name.as_deref(), &v);
                if let Some(u) = se.usage {
                    usage.merge(u);
                }
                if se.usage_only && p.injected_usage {
                    // The client did not ask for it: the gateway did.
                    forward = false;
                } else if p.injected_usage
                    && let Some(rebuilt) = without_null_usage(&v)
                {
                    // Every chunk says `"usage": null` once usage is asked
                    // for; the client did not ask, so it does not see it.
                    raw = rebuilt;
                }
                for piece in se.text_delta.iter() {
                    counted += p.tokenizer.count(piece);
                    output_text.push_str(piece);
                }
                if se.done {
                    saw_done = true;
                }
            }
            if forward && tx.send(Ok(raw)).await.is_err() {
                end = End::ClientGone;
                break 'read;
            }
            // Top up before the hold runs out: a quarter of a tranche early,
            // so the stream rarely waits on the ledger. A request without a
            // bound of its own is not stopped at the model's (the provider
            // was never told it): it goes on, tranche by tranche, until a
            // top-up is refused.
            let early = p.tranche_tokens / 4;
            let room_to_bound = if p.bounded {
                p.output_bound.saturating_sub(held_output)
            } else {
                p.tranche_tokens
            };
            if swapping.is_none() && room_to_bound > 0 && counted + early >= held_output {
                let add = p.tranche_tokens.min(room_to_bound);
                let amounts = Amounts::new().with(Dimension::OUTPUT_TOKENS, add);
                match state
                    .call(
                        state
                            .store()
                            .extend(tenant_id, Some(&amounts), Some(ttl_ms)),
                    )
                    .await
                {
                    Ok(Ok(_)) => {
                        held_output += add;
                    }
                    Ok(Err(StoreError::Rejected(ExtendError::Denied(mut d)))) => {
                        own_hold_blocks(&state, tenant_id, &mut d).await;
                        crate::metrics::denial(&d);
                        let e = GatewayError::denied(&d, state.now(), &p.catalog);
                        let event = stream_error_event(&e, p.flavor, p.api == Api::Responses);
                        let _ = tx.send(Ok(Bytes::from(event))).await;
                        end = End::Cut;
                        break 'read;
                    }
                    other => {
                        // Cannot count what follows: fail closed, cleanly.
                        let why = match other {
                            Ok(Err(e)) => e.to_string(),
                            _ => "the store did not answer in time".to_string(),
                        };
                        let e = GatewayError::unavailable(format!(
                            "the stream's hold could not be topped up: {why}"
                        ));
                        let event = stream_error_event(&e, p.flavor, p.api == Api::Responses);
                        let _ = tx.send(Ok(Bytes::from(event))).await;
                        end = End::Cut;
                        break 'read;
                    }
                }
            }
        }
    }
    // Closing the connection tells the provider to stop generating; its
    // place upstream is free at once (a broken stream may still wait for
    // its error event to reach the client, below).
    drop(upstream);
    drop(permit);
    match end {
        End::Complete => {
            let rest = split.rest();
            if !rest.is_empty() {
                let _ = tx.send(Ok(rest)).await;
            }
        }
        End::UpstreamBroke => {
            // The client must not take a truncated answer for a whole one:
            // an error event it can read, then the body aborted (an
            // incomplete chunked answer, as the provider's own break).
            let e = GatewayError::bad_gateway("the upstream's stream broke off");
            let event = stream_error_event(&e, p.flavor, p.api == Api::Responses);
            if tx.send(Ok(Bytes::from(event))).await.is_ok() {
                // hyper drops what it has not written yet when a body
                // fails: the event must be on the wire before the abort.
                flushed(&tx).await;
                let _ = tx
                    .send(Err(std::io::Error::other(
                        "the upstream's stream broke off",
                    )))
                    .await;
            }
        }
        End::Cut | End::ClientGone => {}
    }
    drop(tx);
    drop(lease);
    // A swap still in flight ends first: the call settles its exact holds.
    if let Some(swap) = swapping.take() {
        finish_swap(
            &state,
            swap.await,
            &mut tenant_id,
            &mut attempt_id,
            &mut refunds,
        );
    }

    // The provider's usage is the whole truth only for a stream it
    // finished: Anthropic's first event already reports an output of 1.
    let reported = if end == End::Complete {
        usage.complete()
    } else {
        None
    };
    // What the provider did not report is settled from the estimate: the
    // exact count, then, waited for. Reported usage needs it only for the
    // estimate's accuracy metric: taken if it is there.
    if let Some(mut c) = counting.take() {
        let count = if reported.is_none() {
            exact_count(c.await)
        } else {
            exact_count(c.try_recv())
        };
        if let Some(n) = count {
            p.set_input_tokens(n);
        }
    }
    let final_usage: Usage = match reported {
        Some(u) => {
            observe_estimate(&p, u.input_tokens);
            ledger_usage(u)
        }
        None => {
            // What was generated, as the gateway saw it.
            let seen = p.tokenizer.count(&output_text);
            let output = seen.max(usage.output_tokens.unwrap_or(0));
            let mut u = estimated_usage(&p, output);
            if let Some(input) = usage.input_tokens {
                u.amounts.set(Dimension::INPUT_TOKENS, input);
                u.cached_input_tokens = usage.cached_input_tokens.unwrap_or(0);
            }
            u
        }
    };
    if let Some(r) = refunds {
        let _ = r.await;
    }
    // Applied now; durable together (one group commit on the durable
    // store), in the background: the client has the whole stream already.
    settle_whole(&state, tenant_id, attempt_id, &final_usage).await;
    if end != End::Complete {
        ::metrics::counter!("allowance_gateway_streams_cut_total", "reason" => end.label())
            .increment(1);
    }
    count_call(
        p.api,
        match end {
            End::Complete => "ok",
            End::Cut => "stream_cut",
            End::ClientGone => "client_gone",
            End::UpstreamBroke => "upstream_broken",
        },
    );
}

/// Most a broken stream waits for its error event to reach the client's
/// connection before the body is aborted (a client that reads that slowly
/// has its answer aborted anyway).
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits until the body has taken every event sent (the channel is empty
/// again: hyper has them), then a moment more for hyper to write them out:
/// once the body has nothing new, hyper flushes what it holds. A body error
/// sent sooner would make hyper drop them unwritten.
async fn flushed(tx: &mpsc::Sender<Result<Bytes, std::io::Error>>) {
    let taken = async {
        while tx.capacity() < tx.max_capacity() && !tx.is_closed() {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let _ = tokio::time::timeout(FLUSH_WAIT, taken).await;
}

/// A swap's reservations being taken: the new ids of the caller's hold and
/// of the attempt's, each `None` when the ledger refused it.
type Swapping = std::pin::Pin<
    Box<dyn std::future::Future<Output = (Option<ReservationId>, Option<ReservationId>)> + Send>,
>;

/// Starts swapping a stream's holds on the bound of its input for holds on
/// the exact count `input_tokens`: a new reservation of each (the caller's
/// with the output held so far), taken while the events flow on; then
/// [`finish_swap`] refunds the old ones. `None` when there is nothing to
/// swap (the count is not below the bound).
///
/// The stream does not wait for it: on the durable store the new holds'
/// reserve is an fsync, which used to stand between the provider's first
/// bytes and the client whenever the count finished just before them.
fn start_swap(
    state: &AppState,
    p: &mut Prepared,
    input_tokens: u64,
    has_attempt: bool,
    held_output: u64,
) -> Option<Swapping> {
    let bound = p.estimate.input_tokens;
    p.set_input_tokens(input_tokens);
    if input_tokens >= bound {
        return None;
    }
    let mut tenant_req = p.tenant_req.clone();
    tenant_req
        .amounts
        .set(Dimension::OUTPUT_TOKENS, held_output);
    tenant_req.report_remaining = false;
    let attempt_req = has_attempt.then(|| p.attempt_req.clone());
    let state = state.clone();
    Some(Box::pin(async move {
        // Both decided, then made durable together: one group commit.
        let attempt = async {
            match &attempt_req {
                Some(req) => admit_decided(&state, req).await.ok()?.ok(),
                None => None,
            }
        };
        let (tenant, attempt) = tokio::join!(admit_decided(&state, &tenant_req), attempt);
        let split = |r: Option<(allowance_core::Granted, allowance_core::Durable)>| match r {
            Some((g, d)) => (Some(g.id), Some(d)),
            None => (None, None),
        };
        let (tenant_id, tenant_durable) = split(tenant.ok().and_then(Result::ok));
        let (attempt_id, attempt_durable) = split(attempt);
        let (tenant_ok, attempt_ok) = tokio::join!(
            durable_by(&state, tenant_durable),
            durable_by(&state, attempt_durable)
        );
        // A hold that never became durable is no swap: the store fenced
        // itself and rebuilds from disk, and the bound's hold stays.
        (
            tenant_id.filter(|_| tenant_ok.is_ok()),
            attempt_id.filter(|_| attempt_ok.is_ok()),
        )
    }))
}

/// Ends a swap: the ids the ledger granted replace the old ones, whose
/// holds are refunded as their own task (`refunds`, waited for before the
/// call settles). A swap the ledger refused (no room for both at once)
/// keeps the bound's hold, which is larger: the call goes on. Returns
/// whether anything was swapped.
fn finish_swap(
    state: &AppState,
    (tenant, attempt): (Option<ReservationId>, Option<ReservationId>),
    tenant_id: &mut ReservationId,
    attempt_id: &mut Option<ReservationId>,
    refunds: &mut Option<tokio::task::JoinHandle<()>>,
) -> bool {
    let mut old = Vec::new();
    if let Some(new) = tenant {
        old.push(std::mem::replace(tenant_id, new));
    }
    if let (Some(new), Some(id)) = (attempt, attempt_id.as_mut()) {
        old.push(std::mem::replace(id, new));
    }
    if old.is_empty() {
        return false;
    }
    // A stream swaps once (its count comes once): no earlier refunds.
    let state = state.clone();
    *refunds = Some(tokio::spawn(async move {
        futures_util::future::join_all(old.into_iter().map(|id| refund(&state, id))).await;
    }));
    true
}

/// A chat chunk as it would read had usage not been asked for: its
/// `"usage": null` member gone (`None` when it has none).
fn without_null_usage(v: &Value) -> Option<Bytes> {
    let obj = v.as_object()?;
    if !matches!(obj.get("usage"), Some(Value::Null)) {
        return None;
    }
    let mut obj = obj.clone();
    obj.remove("usage");
    let json = serde_json::to_string(&obj).ok()?;
    Some(Bytes::from(format!("data: {json}\n\n")))
}

/// A top-up refused because the stream's own hold takes the room left:
/// waiting cannot help it (the room comes back only when it ends), so it
/// is told its budget is spent, not to retry. The ledger says so itself
/// when the stream's hold and the top-up together pass the limit's whole
/// capacity (`exceeds_limit`: for this call, the budget is gone); otherwise
/// it is recognised by the earliest hold to end on the refusing scope
/// being the stream's own.
async fn own_hold_blocks(state: &AppState, id: ReservationId, d: &mut allowance_core::Denial) {
    if d.kind == allowance_core::DenialKind::ExceedsLimit {
        d.kind = allowance_core::DenialKind::BudgetExhausted;
        d.retry_after_ms = None;
        return;
    }
    if d.kind != allowance_core::DenialKind::RateLimited {
        return;
    }
    let Some(retry_ms) = d.retry_after_ms else {
        return;
    };
    let Ok(Ok(Some(own))) = state.call(state.store().get(id)).await else {
        return;
    };
    let own_left_ms = own
        .expires_at
        .as_millis()
        .saturating_sub(state.now().as_millis());
    // A few ms of slack: the store's instant and ours differ slightly.
    if retry_ms + 50 >= own_left_ms {
        d.kind = allowance_core::DenialKind::BudgetExhausted;
        d.retry_after_ms = None;
    }
}
