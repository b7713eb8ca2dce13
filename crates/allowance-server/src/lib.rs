//! # allowance-server — the HTTP service around a ledger store
//!
//! [`app`] builds the axum [`Router`] of HTTP-API.md (data plane, admin
//! plane, health, metrics, OpenAPI) over any [`Store`]; it can be tested
//! without a socket. [`serve`] runs it on a listener with the background
//! expiry sweeper and graceful shutdown.
//!
//! ```
//! use std::sync::Arc;
//! use allowance_server::{app, AppState, Credentials, Options, SystemClock, RandomIds};
//! use allowance_core::EmbeddedStore;
//!
//! let config = allowance_config::starter();
//! let store = EmbeddedStore::new(config.catalog.clone(), 16, Arc::new(SystemClock::default()), Arc::new(RandomIds));
//! let state = AppState::new(Arc::new(store), Credentials::default(), Options::default());
//! let router: axum::Router = app(state);
//! ```

#![forbid(unsafe_code)]

mod admin;
pub mod auth;
mod clock;
pub mod error;
pub mod extract;
pub mod gateway;
pub mod headers;
pub mod metrics;
mod openapi;
mod queue;
mod routes;
mod usage;
pub mod wire;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use allowance_core::{Clock, Store};
use axum::Router;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

pub use auth::{Credential, Credentials, Principal, new_token, token_sha256_hex};
pub use clock::{RandomIds, SystemClock};
pub use error::ApiError;
pub use openapi::openapi_json;
pub use queue::{AdmissionQueue, QueueLimits, RECHECK};

/// Server knobs that are not the ledger's.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bound on every store call (`[store] timeout_ms`); past it, 503.
    pub store_timeout: Duration,
    /// Bound on a whole request; past it, 503 (the outcome is unknown).
    pub request_timeout: Duration,
    /// `[queue] max_wait_ms`: the largest `wait_ms` a reserve may ask.
    pub max_wait_ms: u64,
    /// How often the background sweeper expires abandoned holds.
    pub sweep_interval: Duration,
    /// `[queue] max_waiters_per_tenant` and `max_waiters`.
    pub queue_limits: QueueLimits,
    /// `[gateway]`, resolved: when set, the server also answers the
    /// OpenAI- and Anthropic-compatible routes.
    pub gateway: Option<Arc<gateway::Gateway>>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            store_timeout: Duration::from_millis(1_000),
            request_timeout: Duration::from_secs(30),
            max_wait_ms: 60_000,
            sweep_interval: Duration::from_millis(250),
            queue_limits: QueueLimits::default(),
            gateway: None,
        }
    }
}

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    credentials: Credentials,
    options: Options,
    metrics: PrometheusHandle,
    clock: Arc<dyn Clock>,
    /// Admin changes that register custom dimensions before a plan are two
    /// catalog changes: they must not interleave.
    admin: tokio::sync::Mutex<()>,
    queue: Arc<AdmissionQueue>,
}

impl AppState {
    /// State over `store`, with the wall clock for denial headers.
    pub fn new(store: Arc<dyn Store>, credentials: Credentials, options: Options) -> Self {
        Self::with_clock(
            store,
            credentials,
            options,
            Arc::new(SystemClock::default()),
        )
    }

    /// State with an explicit clock (the store's, in tests with a manual clock).
    pub fn with_clock(
        store: Arc<dyn Store>,
        credentials: Credentials,
        options: Options,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let queue = Arc::new(AdmissionQueue::new(options.queue_limits, store.is_shared()));
        // Room freed through another server sharing the store wakes the
        // queue too (a no-op for a store only this process writes).
        let waker = queue.clone();
        store.on_room_freed(Arc::new(move || waker.kick()));
        AppState {
            inner: Arc::new(Inner {
                store,
                credentials,
                options,
                metrics: metrics::install(),
                clock,
                admin: tokio::sync::Mutex::new(()),
                queue,
            }),
        }
    }

    pub(crate) fn store(&self) -> &dyn Store {
        &*self.inner.store
    }

    pub(crate) fn credentials(&self) -> &Credentials {
        &self.inner.credentials
    }

    pub(crate) fn options(&self) -> &Options {
        &self.inner.options
    }

    pub(crate) fn now(&self) -> allowance_core::Timestamp {
        self.inner.clock.now()
    }

    /// The gateway, when configured.
    pub(crate) fn gateway(&self) -> Option<&gateway::Gateway> {
        self.inner.options.gateway.as_deref()
    }

    /// The admission queue (`wait_ms`).
    pub fn queue(&self) -> &Arc<AdmissionQueue> {
        &self.inner.queue
    }

    pub(crate) fn admin_lock(&self) -> &tokio::sync::Mutex<()> {
        &self.inner.admin
    }

    pub(crate) fn metrics(&self) -> &PrometheusHandle {
        &self.inner.metrics
    }

    /// The catalog in force (one store call, under the timeout).
    pub(crate) async fn catalog(&self) -> Result<Arc<allowance_core::Catalog>, ApiError> {
        Ok(self.call(self.store().catalog()).await??)
    }

    /// Runs a store call under the store timeout: past it, 503.
    pub(crate) fn call<F: Future + Unpin>(&self, f: F) -> StoreCall<F> {
        StoreCall {
            inner: f,
            timeout: self.inner.options.store_timeout,
            sleep: None,
        }
    }
}

/// A store call under the store timeout ([`AppState::call`]). The timer is
/// armed only if the call does not answer on its first poll: the embedded
/// store always answers at once, so its calls never touch the timer wheel
/// (nor read the clock). A call that waits (Redis, a group commit) gets its
/// whole timeout from that first poll, which has sent the request.
pub(crate) struct StoreCall<F> {
    inner: F,
    timeout: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<F: Future + Unpin> Future for StoreCall<F> {
    type Output = Result<F::Output, ApiError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Poll::Ready(v) = Pin::new(&mut this.inner).poll(cx) {
            return Poll::Ready(Ok(v));
        }
        let timeout = this.timeout;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(ApiError::unavailable(
                "the store did not answer in time",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The whole HTTP API over `state`.
pub fn app(state: AppState) -> Router {
    // A reserve may wait in the queue for up to `max_wait_ms` on top.
    let timeout =
        state.options().request_timeout + Duration::from_millis(state.options().max_wait_ms);
    let with_gateway = state.gateway().is_some();
    let router = routes::router()
        .merge(admin::router())
        .merge(openapi::router())
        .fallback(|| async { ApiError::no_route() })
        .method_not_allowed_fallback(|uri: axum::http::Uri| async move {
            admin::method_not_allowed(uri.path())
        })
        .layer(tower::layer::layer_fn(move |inner| RequestTimeout {
            inner,
            timeout,
        }));
    // Gateway calls last as long as the provider generates: outside the
    // request timeout (they bound their upstream time themselves).
    let router = if with_gateway {
        router.merge(gateway::router())
    } else {
        router
    };
    router.with_state(state)
}

/// The whole-request bound (reading the body included) as a plain tower
/// service: `axum::middleware::from_fn` cloned the inner route and boxed a
/// future for every request, ~15% of the server's CPU per reserve+settle
/// pair in alternating runs of `allowance bench`.
#[derive(Clone)]
struct RequestTimeout<S> {
    inner: S,
    timeout: Duration,
}

type Timed<F> = futures_util::future::Map<
    tokio::time::Timeout<F>,
    fn(
        Result<Result<Response, std::convert::Infallible>, tokio::time::error::Elapsed>,
    ) -> Result<Response, std::convert::Infallible>,
>;

impl<S> tower::Service<Request> for RequestTimeout<S>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible>,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = Timed<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        use futures_util::FutureExt;
        tokio::time::timeout(self.timeout, self.inner.call(req)).map(|r| match r {
            Ok(answer) => answer,
            Err(_) => Ok(ApiError::unavailable(
                "the request took too long; its outcome is unknown: retry it",
            )
            .into_response()),
        })
    }
}

/// How many failed sweeps in a row make one log line.
const SWEEP_FAILURE_LOG_EVERY: u64 = 40;

/// Expires abandoned holds every `interval` (expiry is also observed
/// lazily by every operation; this keeps idle scopes' holds from lingering
/// and the metrics true).
pub fn spawn_sweeper(state: &AppState) -> tokio::task::JoinHandle<()> {
    let state = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(state.options().sweep_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_expired = 0;
        // Failures in a row: logged at the first and then every
        // `SWEEP_FAILURE_LOG_EVERY` (four lines a second for a whole outage
        // drowned the log), and once more when the store answers again.
        let mut failing: u64 = 0;
        loop {
            tick.tick().await;
            let why = match state.call(state.store().expire_due()).await {
                Ok(Ok(expired)) => {
                    if failing > 0 {
                        tracing::info!(
                            failed_sweeps = failing,
                            "expiry sweep: the store answers again"
                        );
                        failing = 0;
                    }
                    if expired != last_expired {
                        // Expiries free room: the queue looks again.
                        last_expired = expired;
                        state.queue().kick();
                    }
                    continue;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => "the store did not answer in time".to_string(),
            };
            metrics::store_error("expire");
            if failing.is_multiple_of(SWEEP_FAILURE_LOG_EVERY) {
                tracing::warn!(error = %why, failed_sweeps = failing + 1, "expiry sweep failed");
            }
            failing += 1;
        }
    })
}

/// Serves `state` on `listener` until `shutdown` resolves, then finishes
/// the requests in flight and returns.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let sweeper = spawn_sweeper(&state);
    // Small JSON answers: Nagle's delay would add up to 40 ms to each.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let result = axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await;
    sweeper.abort();
    result
}

/// Resolves on SIGTERM, SIGINT (Ctrl-C) or SIGHUP (there is no reload).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let unix = |kind: tokio::signal::unix::SignalKind| async move {
        match tokio::signal::unix::signal(kind) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(unix)]
    let (term, hangup) = (
        unix(tokio::signal::unix::SignalKind::terminate()),
        // There is no reload to do on a hang-up; its default action would
        // drop the requests in flight, so it stops the server as SIGTERM does.
        unix(tokio::signal::unix::SignalKind::hangup()),
    );
    #[cfg(not(unix))]
    let (term, hangup) = (std::future::pending::<()>(), std::future::pending::<()>());
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
        _ = hangup => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}

/// Convenience for handlers: `Response` from a `Result`.
pub(crate) fn respond<T: IntoResponse>(r: Result<T, ApiError>) -> Response {
    match r {
        Ok(v) => v.into_response(),
        Err(e) => e.into_response(),
    }
}
