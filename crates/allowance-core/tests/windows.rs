//! Every window kind and the reservation rules around it, figure for figure,
//! as data: each test is a configuration and a list of steps (`reserve`,
//! `settle`, `advance`, `expect`, …) run through the public [`Ledger`] API by
//! one `check` function, so renaming an API touches the runner only.
//!
//! Every expected figure was computed by hand from SEMANTICS.md (calendar
//! instants with `date -u -d … +%s`), never read back from the engine. After
//! every step the runner checks the ledger's invariants, and around every
//! step expected to fail (a denial, an invalid input, a conflict) or to
//! change nothing (a dry run, a replay) it compares the full observable state
//! before and after.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use allowance_core::calendar::window_bounds;
use allowance_core::*;

// ============================================================================
// The script language
// ============================================================================

/// Amounts by dimension name, as a test writes them.
type Dims = &'static [(&'static str, u64)];

/// One limit of a plan, dimension by name (custom ones are registered).
#[derive(Clone, Debug)]
struct L(&'static str, u64, Window);

fn sliding(dim: &'static str, capacity: u64, period_ms: u64, slices: u32) -> L {
    L(dim, capacity, Window::Sliding { period_ms, slices })
}

fn bucket(dim: &'static str, capacity: u64, period_ms: u64) -> L {
    L(dim, capacity, Window::Bucket { period_ms })
}

fn calendar(dim: &'static str, capacity: u64, unit: CalendarUnit, zone: &str) -> L {
    let zone = Zone::named(zone).expect("a known zone");
    L(dim, capacity, Window::Calendar { unit, zone })
}

fn total(dim: &'static str, capacity: u64) -> L {
    L(dim, capacity, Window::Total)
}

fn concurrent(capacity: u64) -> L {
    L("concurrent", capacity, Window::Concurrent)
}

fn make_plan(c: &mut Catalog, name: &str, policy: OverrunPolicy, limits: Vec<L>) -> Arc<Plan> {
    let limits = limits
        .into_iter()
        .map(|L(d, cap, w)| {
            let dim = c.add_dimension(d).expect("a valid dimension name");
            Limit::new(dim, cap, w).expect("a valid limit")
        })
        .collect();
    Plan::new(name, limits, policy).expect("a valid plan")
}

/// The configuration a script starts from. Each kind gets a plan of its own
/// name.
struct Setup(Catalog);

fn setup() -> Setup {
    Setup(Catalog::default())
}

fn setup_with(settings: Settings) -> Setup {
    Setup(Catalog::new(settings).expect("valid settings"))
}

impl Setup {
    fn kind(self, name: &str, limits: Vec<L>) -> Self {
        self.kind_with(name, OverrunPolicy::ChargeActual, limits)
    }

    fn kind_with(mut self, name: &str, policy: OverrunPolicy, limits: Vec<L>) -> Self {
        let p = make_plan(&mut self.0, name, policy, limits);
        self.0.set_plan(p);
        self.0.set_kind(name, Some(name), false).unwrap();
        self
    }

    /// A named plan no kind uses by default (for overrides).
    fn plan(mut self, name: &str, limits: Vec<L>) -> Self {
        let p = make_plan(&mut self.0, name, OverrunPolicy::ChargeActual, limits);
        self.0.set_plan(p);
        self
    }

    fn model(mut self, name: &str, input: u64, cached: u64, output: u64) -> Self {
        let price = ModelPrice {
            input_micros_per_million: input,
            cached_input_micros_per_million: cached,
            output_micros_per_million: output,
            max_output_tokens: 4096,
            tokenizer: "o200k_base".into(),
        };
        self.0.set_model(name, price).unwrap();
        self
    }
}

/// What a step is expected to answer.
#[derive(Clone, Debug, Default)]
enum Want {
    /// Granted / done (for a reserve: a fresh reservation, not a replay).
    #[default]
    Ok,
    Denied(Deny),
    Invalid(&'static str),
    /// A settle of a refunded or a refund of a settled reservation, or an
    /// idempotency key bound to another request.
    Conflict,
    NotFound,
    NotHeld(Status),
    /// A reserve answering the existing reservation of that name.
    Replays(&'static str),
}

/// An expected denial: kind, scope and dimension always, the rest when given.
#[derive(Clone, Debug)]
struct Deny {
    kind: DenialKind,
    scope: &'static str,
    dimension: &'static str,
    retry_after_ms: Option<u64>,
    window: Option<WindowKind>,
    capacity: Option<u64>,
    remaining: Option<i64>,
    requested: Option<u64>,
    resets_at: Option<Option<u64>>,
}

fn deny(
    kind: DenialKind,
    scope: &'static str,
    dimension: &'static str,
    retry: Option<u64>,
) -> Deny {
    Deny {
        kind,
        scope,
        dimension,
        retry_after_ms: retry,
        window: None,
        capacity: None,
        remaining: None,
        requested: None,
        resets_at: None,
    }
}

fn rate_limited(scope: &'static str, dimension: &'static str, retry_after_ms: u64) -> Deny {
    deny(
        DenialKind::RateLimited,
        scope,
        dimension,
        Some(retry_after_ms),
    )
}

fn budget_exhausted(scope: &'static str, dimension: &'static str) -> Deny {
    deny(DenialKind::BudgetExhausted, scope, dimension, None)
}

fn exceeds_limit(scope: &'static str, dimension: &'static str) -> Deny {
    deny(DenialKind::ExceedsLimit, scope, dimension, None)
}

impl Deny {
    /// Window kind, capacity, remaining, requested and resets_at at once:
    /// every field a denial carries.
    fn fields(
        mut self,
        window: WindowKind,
        capacity: u64,
        remaining: i64,
        requested: u64,
        resets_at: Option<u64>,
    ) -> Self {
        self.window = Some(window);
        self.capacity = Some(capacity);
        self.remaining = Some(remaining);
        self.requested = Some(requested);
        self.resets_at = Some(resets_at);
        self
    }
}

/// What a reservation operation does.
#[derive(Clone, Debug)]
enum OpKind {
    Reserve {
        tenant: &'static str,
        scopes: &'static [(&'static str, &'static str)],
        amounts: Dims,
        model: Option<&'static str>,
        ttl_ms: Option<u64>,
        key: Option<&'static str>,
        dry_run: bool,
    },
    Settle {
        usage: Dims,
        cached_input_tokens: u64,
        charges: Vec<(&'static str, u64, Dims)>,
    },
    Refund,
    Extend {
        amounts: Option<Dims>,
        ttl_ms: Option<u64>,
    },
    Get,
}

/// A reservation operation on the reservation called `name`, its expected
/// answer, and what the reservation must look like afterwards.
#[derive(Clone, Debug)]
struct Op {
    name: &'static str,
    kind: OpKind,
    want: Want,
    status: Option<Status>,
    held: Option<Dims>,
    expires_at: Option<u64>,
    charged: Option<Dims>,
    late: Option<bool>,
    gone: bool,
}

/// An expected figure of one limit of one scope.
#[derive(Clone, Debug)]
struct Exp {
    scope: &'static str,
    dimension: &'static str,
    window: Option<WindowKind>,
    used: Option<i64>,
    held: Option<u64>,
    remaining: Option<i64>,
    resets_at: Option<Option<u64>>,
    plan: Option<&'static str>,
}

/// A change of configuration at run time.
struct Admin(&'static str, Box<dyn FnOnce(&mut Catalog)>);

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Admin({})", self.0)
    }
}

#[derive(Debug)]
enum Step {
    /// Go to this instant (ms since the epoch).
    At(u64),
    /// Let this many ms pass.
    Advance(u64),
    Op(Op),
    Expect(Exp),
    Adjust {
        scope: &'static str,
        dimension: &'static str,
        credit: i64,
        found: bool,
    },
    Admin(Admin),
    /// `expire_due`, and the total of holds it reports expired so far.
    ExpireDue(Option<u64>),
    /// `scope_count`, `reservation_count`, `held_count`.
    Counts {
        scopes: Option<usize>,
        reservations: Option<usize>,
        held: Option<usize>,
    },
}

fn at(ms: u64) -> Step {
    Step::At(ms)
}

fn advance(ms: u64) -> Step {
    Step::Advance(ms)
}

fn op(name: &'static str, kind: OpKind) -> Step {
    Step::Op(Op {
        name,
        kind,
        want: Want::Ok,
        status: None,
        held: None,
        expires_at: None,
        charged: None,
        late: None,
        gone: false,
    })
}

/// A reserve of `amounts` on the tenant and `scopes` (kind, id).
fn reserve(
    name: &'static str,
    tenant: &'static str,
    scopes: &'static [(&'static str, &'static str)],
    amounts: Dims,
) -> Step {
    op(
        name,
        OpKind::Reserve {
            tenant,
            scopes,
            amounts,
            model: None,
            ttl_ms: None,
            key: None,
            dry_run: false,
        },
    )
}

fn settle(name: &'static str, usage: Dims) -> Step {
    op(
        name,
        OpKind::Settle {
            usage,
            cached_input_tokens: 0,
            charges: Vec::new(),
        },
    )
}

fn refund(name: &'static str) -> Step {
    op(name, OpKind::Refund)
}

fn extend(name: &'static str, amounts: Option<Dims>, ttl_ms: Option<u64>) -> Step {
    op(name, OpKind::Extend { amounts, ttl_ms })
}

fn get(name: &'static str) -> Step {
    op(name, OpKind::Get)
}

fn expect(scope: &'static str, dimension: &'static str) -> Step {
    Step::Expect(Exp {
        scope,
        dimension,
        window: None,
        used: None,
        held: None,
        remaining: None,
        resets_at: None,
        plan: None,
    })
}

fn adjust(scope: &'static str, dimension: &'static str, credit: i64) -> Step {
    Step::Adjust {
        scope,
        dimension,
        credit,
        found: true,
    }
}

fn set_plan(name: &'static str, policy: OverrunPolicy, limits: Vec<L>) -> Step {
    Step::Admin(Admin(
        "set_plan",
        Box::new(move |c| {
            let p = make_plan(c, name, policy, limits);
            c.set_plan(p);
        }),
    ))
}

fn override_plan(scope: &'static str, plan: &'static str) -> Step {
    Step::Admin(Admin(
        "override_plan",
        Box::new(move |c| {
            let key = ScopeKey::parse(scope).unwrap();
            c.set_override(key, Override::Plan(plan.into())).unwrap();
        }),
    ))
}

fn override_limits(scope: &'static str, limits: Vec<L>) -> Step {
    Step::Admin(Admin(
        "override_limits",
        Box::new(move |c| {
            let p = make_plan(c, "own", OverrunPolicy::ChargeActual, limits);
            let key = ScopeKey::parse(scope).unwrap();
            c.set_override(key, Override::Limits(p)).unwrap();
        }),
    ))
}

fn clear_override(scope: &'static str) -> Step {
    Step::Admin(Admin(
        "clear_override",
        Box::new(move |c| {
            assert!(c.clear_override(&ScopeKey::parse(scope).unwrap()));
        }),
    ))
}

fn expire_due(total_expired: u64) -> Step {
    Step::ExpireDue(Some(total_expired))
}

fn counts(scopes: usize, reservations: usize, held: usize) -> Step {
    Step::Counts {
        scopes: Some(scopes),
        reservations: Some(reservations),
        held: Some(held),
    }
}

fn scope_count(scopes: usize) -> Step {
    Step::Counts {
        scopes: Some(scopes),
        reservations: None,
        held: None,
    }
}

fn reservation_count(reservations: usize) -> Step {
    Step::Counts {
        scopes: None,
        reservations: Some(reservations),
        held: None,
    }
}

/// Modifiers: each applies to the step kinds it names and panics on others,
/// so a misuse fails loudly instead of being ignored.
impl Step {
    fn op_mut(&mut self, what: &str) -> &mut Op {
        match self {
            Step::Op(o) => o,
            other => panic!("{what} applies to a reservation operation, not {other:?}"),
        }
    }

    fn reserve_mut(
        &mut self,
        what: &str,
    ) -> (
        &mut Option<&'static str>,
        &mut Option<u64>,
        &mut Option<&'static str>,
        &mut bool,
    ) {
        match &mut self.op_mut(what).kind {
            OpKind::Reserve {
                model,
                ttl_ms,
                key,
                dry_run,
                ..
            } => (model, ttl_ms, key, dry_run),
            other => panic!("{what} applies to a reserve, not {other:?}"),
        }
    }

    fn exp_mut(&mut self, what: &str) -> &mut Exp {
        match self {
            Step::Expect(e) => e,
            other => panic!("{what} applies to expect, not {other:?}"),
        }
    }

    // ---- reserve options
    fn ttl(mut self, ms: u64) -> Self {
        *self.reserve_mut("ttl").1 = Some(ms);
        self
    }
    fn key(mut self, key: &'static str) -> Self {
        *self.reserve_mut("key").2 = Some(key);
        self
    }
    fn model(mut self, model: &'static str) -> Self {
        *self.reserve_mut("model").0 = Some(model);
        self
    }
    fn dry_run(mut self) -> Self {
        *self.reserve_mut("dry_run").3 = true;
        self
    }

    // ---- settle options
    fn cached(mut self, tokens: u64) -> Self {
        match &mut self.op_mut("cached").kind {
            OpKind::Settle {
                cached_input_tokens,
                ..
            } => *cached_input_tokens = tokens,
            other => panic!("cached applies to a settle, not {other:?}"),
        }
        self
    }
    fn charge(mut self, name: &'static str, cost_micros: u64, amounts: Dims) -> Self {
        match &mut self.op_mut("charge").kind {
            OpKind::Settle { charges, .. } => charges.push((name, cost_micros, amounts)),
            other => panic!("charge applies to a settle, not {other:?}"),
        }
        self
    }

    // ---- expected answers
    fn denied(mut self, d: Deny) -> Self {
        self.op_mut("denied").want = Want::Denied(d);
        self
    }
    fn invalid(mut self, field: &'static str) -> Self {
        self.op_mut("invalid").want = Want::Invalid(field);
        self
    }
    fn conflict(mut self) -> Self {
        self.op_mut("conflict").want = Want::Conflict;
        self
    }
    fn not_found(mut self) -> Self {
        match &mut self {
            Step::Adjust { found, .. } => *found = false,
            s => s.op_mut("not_found").want = Want::NotFound,
        }
        self
    }
    fn not_held(mut self, status: Status) -> Self {
        self.op_mut("not_held").want = Want::NotHeld(status);
        self
    }
    fn replays(mut self, name: &'static str) -> Self {
        self.op_mut("replays").want = Want::Replays(name);
        self
    }
    /// The reservation is no longer remembered (`get` answers `None`).
    fn gone(mut self) -> Self {
        self.op_mut("gone").gone = true;
        self
    }

    // ---- the reservation afterwards
    fn status(mut self, s: Status) -> Self {
        self.op_mut("status").status = Some(s);
        self
    }
    fn held(mut self, d: Dims) -> Self {
        self.op_mut("held").held = Some(d);
        self
    }
    fn expires_at(mut self, ms: u64) -> Self {
        self.op_mut("expires_at").expires_at = Some(ms);
        self
    }
    fn charged(mut self, d: Dims) -> Self {
        self.op_mut("charged").charged = Some(d);
        self
    }
    fn late(mut self, late: bool) -> Self {
        self.op_mut("late").late = Some(late);
        self
    }

    // ---- expect (a limit's status)
    fn window(mut self, w: WindowKind) -> Self {
        self.exp_mut("window").window = Some(w);
        self
    }
    fn used(mut self, n: i64) -> Self {
        self.exp_mut("used").used = Some(n);
        self
    }
    fn holding(mut self, n: u64) -> Self {
        self.exp_mut("holding").held = Some(n);
        self
    }
    fn remaining(mut self, n: i64) -> Self {
        self.exp_mut("remaining").remaining = Some(n);
        self
    }
    fn resets_at(mut self, at: Option<u64>) -> Self {
        self.exp_mut("resets_at").resets_at = Some(at);
        self
    }
    fn on_plan(mut self, plan: &'static str) -> Self {
        self.exp_mut("on_plan").plan = Some(plan);
        self
    }
}

// ============================================================================
// The runner
// ============================================================================

struct World {
    ledger: Ledger,
    now_ms: u64,
    ids: HashMap<&'static str, ReservationId>,
    next_id: u128,
    /// Every scope a step named, for before/after comparisons.
    scopes: Vec<ScopeKey>,
}

/// Everything a caller can observe, for "nothing changed" checks.
type Snapshot = (Vec<ScopeStatus>, Vec<Option<Reservation>>, usize);

fn amounts_of(c: &Catalog, d: Dims) -> Amounts {
    d.iter()
        .map(|&(name, a)| {
            let dim = c
                .dimension(name)
                .unwrap_or_else(|| panic!("unknown dimension {name}"));
            (dim, a)
        })
        .collect()
}

impl World {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now_ms)
    }

    fn id(&mut self, name: &'static str) -> ReservationId {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = self.fresh_id();
        self.ids.insert(name, id);
        id
    }

    fn fresh_id(&mut self) -> ReservationId {
        self.next_id += 1;
        ReservationId(self.next_id)
    }

    fn note_scope(&mut self, key: &ScopeKey) {
        if !self.scopes.contains(key) {
            self.scopes.push(key.clone());
        }
    }

    fn snapshot(&mut self) -> Snapshot {
        let now = self.now();
        let scopes = self.scopes.clone();
        let statuses = scopes.iter().map(|k| self.ledger.status(now, k)).collect();
        let mut ids: Vec<ReservationId> = self.ids.values().copied().collect();
        ids.sort();
        let res = ids
            .into_iter()
            .map(|id| self.ledger.get(now, id).cloned())
            .collect();
        (statuses, res, self.ledger.reservation_count())
    }

    fn check_denial(&self, got: &Denial, want: &Deny, ctx: &str) {
        // Every 429 carries a finite retry of at least 1 ms; hard stops none.
        match got.kind {
            DenialKind::RateLimited => {
                assert!(got.retry_after_ms.is_some_and(|r| r >= 1), "{ctx}: {got:?}")
            }
            _ => assert_eq!(got.retry_after_ms, None, "{ctx}: {got:?}"),
        }
        let fields = (
            got.kind,
            got.scope.as_str(),
            got.dimension.as_str(),
            got.retry_after_ms,
        );
        let wanted = (want.kind, want.scope, want.dimension, want.retry_after_ms);
        assert_eq!(fields, wanted, "{ctx}: {got:?}");
        if let Some(w) = want.window {
            assert_eq!(got.window, w, "{ctx}: window of {got:?}");
        }
        if let Some(c) = want.capacity {
            assert_eq!(got.capacity, c, "{ctx}: capacity of {got:?}");
        }
        if let Some(r) = want.remaining {
            assert_eq!(got.remaining, r, "{ctx}: remaining of {got:?}");
        }
        if let Some(r) = want.requested {
            assert_eq!(got.requested, r, "{ctx}: requested of {got:?}");
        }
        if let Some(r) = want.resets_at {
            assert_eq!(
                got.resets_at.map(Timestamp::as_millis),
                r,
                "{ctx}: resets_at of {got:?}"
            );
        }
    }

    fn run_op(&mut self, o: Op, ctx: &str) {
        let now = self.now();
        let catalog = self.ledger.catalog().clone();
        // Refusals, replays, reads, dry runs and the refund of an expired
        // reservation must leave everything as it was.
        let quiet = !matches!(o.want, Want::Ok)
            || matches!(o.kind, OpKind::Get | OpKind::Reserve { dry_run: true, .. })
            || (matches!(o.kind, OpKind::Refund) && o.status == Some(Status::Expired));
        // Name every scope and id first, so the snapshot covers them.
        match &o.kind {
            OpKind::Reserve { tenant, scopes, .. } => {
                let set = catalog.scope_set(tenant, scopes).expect("valid scopes");
                for k in set.as_slice() {
                    self.note_scope(k);
                }
            }
            _ => {
                self.id(o.name);
            }
        }
        let before = quiet.then(|| self.snapshot());
        // The id to look the reservation up by afterwards.
        let mut subject = None;
        match o.kind.clone() {
            OpKind::Reserve {
                tenant,
                scopes,
                amounts,
                model,
                ttl_ms,
                key,
                dry_run,
            } => {
                let set = catalog.scope_set(tenant, scopes).expect("valid scopes");
                let mut req = ReserveRequest::new(set, amounts_of(&catalog, amounts));
                req.model = model.map(Into::into);
                req.ttl_ms = ttl_ms;
                req.idempotency_key = key.map(Into::into);
                req.dry_run = dry_run;
                let id = self.fresh_id();
                let got = self.ledger.reserve(now, id, &req);
                match (&o.want, got) {
                    (Want::Ok, Ok(g)) => {
                        assert!(!g.replayed, "{ctx}: a fresh grant, not a replay: {g:?}");
                        assert_eq!((g.id, g.dry_run), (id, dry_run), "{ctx}: {g:?}");
                        if let Some(h) = o.held {
                            assert_eq!(g.held, amounts_of(&catalog, h), "{ctx}: held");
                        }
                        if let Some(e) = o.expires_at {
                            assert_eq!(g.expires_at.as_millis(), e, "{ctx}: expires_at");
                        }
                        if !dry_run {
                            self.ids.insert(o.name, id);
                            subject = Some(id);
                        }
                    }
                    (Want::Replays(name), Ok(g)) => {
                        let original = self.ids[name];
                        assert!(g.replayed, "{ctx}: a replay: {g:?}");
                        assert_eq!(g.id, original, "{ctx}: the original id");
                        subject = Some(original);
                    }
                    (Want::Denied(d), Err(ReserveError::Denied(got))) => {
                        self.check_denial(&got, d, ctx)
                    }
                    (Want::Invalid(f), Err(ReserveError::Invalid(e))) => {
                        assert_eq!(e.field, *f, "{ctx}: {e}")
                    }
                    (Want::Conflict, Err(ReserveError::IdempotencyConflict { .. })) => {}
                    (want, got) => panic!("{ctx}: wanted {want:?}, got {got:?}"),
                }
            }
            OpKind::Settle {
                usage,
                cached_input_tokens,
                charges,
            } => {
                let id = self.id(o.name);
                let usage = Usage {
                    amounts: amounts_of(&catalog, usage),
                    cached_input_tokens,
                    charges: charges
                        .iter()
                        .map(|&(name, cost_micros, a)| Charge {
                            name: name.into(),
                            cost_micros,
                            amounts: amounts_of(&catalog, a),
                        })
                        .collect(),
                };
                let got = self.ledger.settle(now, id, &usage).cloned();
                match (&o.want, got) {
                    (Want::Ok, Ok(r)) => {
                        assert_eq!(r.status, Status::Settled, "{ctx}: {r:?}");
                        subject = Some(id);
                    }
                    (Want::Invalid(f), Err(SettleError::Invalid(e))) => {
                        assert_eq!(e.field, *f, "{ctx}: {e}")
                    }
                    (Want::Conflict, Err(SettleError::Conflict { .. })) => {}
                    (Want::NotFound, Err(SettleError::NotFound)) => {}
                    (want, got) => panic!("{ctx}: wanted {want:?}, got {got:?}"),
                }
            }
            OpKind::Refund => {
                let id = self.id(o.name);
                match (&o.want, self.ledger.refund(now, id).cloned()) {
                    (Want::Ok, Ok(_)) => subject = Some(id),
                    (Want::Conflict, Err(RefundError::Conflict { .. })) => {}
                    (Want::NotFound, Err(RefundError::NotFound)) => {}
                    (want, got) => panic!("{ctx}: wanted {want:?}, got {got:?}"),
                }
            }
            OpKind::Extend { amounts, ttl_ms } => {
                let id = self.id(o.name);
                let a = amounts.map(|d| amounts_of(&catalog, d));
                let got = self.ledger.extend(now, id, a.as_ref(), ttl_ms).cloned();
                match (&o.want, got) {
                    (Want::Ok, Ok(_)) => subject = Some(id),
                    (Want::Denied(d), Err(ExtendError::Denied(got))) => {
                        self.check_denial(&got, d, ctx);
                        subject = Some(id);
                    }
                    (Want::NotHeld(s), Err(ExtendError::NotHeld { status })) => {
                        assert_eq!(status, *s, "{ctx}")
                    }
                    (Want::NotFound, Err(ExtendError::NotFound)) => {}
                    (Want::Invalid(f), Err(ExtendError::Invalid(e))) => {
                        assert_eq!(e.field, *f, "{ctx}: {e}")
                    }
                    (want, got) => panic!("{ctx}: wanted {want:?}, got {got:?}"),
                }
            }
            OpKind::Get => {
                let id = self.id(o.name);
                let got = self.ledger.get(now, id).cloned();
                assert_eq!(got.is_none(), o.gone, "{ctx}: {got:?}");
                subject = got.map(|r| r.id);
            }
        }
        if let Some(before) = before {
            assert_eq!(before, self.snapshot(), "{ctx}: changed the ledger");
        }
        if let Some(id) = subject {
            let r = self
                .ledger
                .get(now, id)
                .unwrap_or_else(|| panic!("{ctx}: reservation gone"))
                .clone();
            if let Some(s) = o.status {
                assert_eq!(r.status, s, "{ctx}: status of {r:?}");
            }
            if let Some(h) = o.held {
                assert_eq!(r.held, amounts_of(&catalog, h), "{ctx}: held of {r:?}");
            }
            if let Some(e) = o.expires_at {
                assert_eq!(r.expires_at.as_millis(), e, "{ctx}: expires_at of {r:?}");
            }
            if let Some(c) = o.charged {
                let c = Some(amounts_of(&catalog, c));
                assert_eq!(r.charged, c, "{ctx}: charged of {r:?}");
            }
            if let Some(l) = o.late {
                assert_eq!(r.late, l, "{ctx}: late of {r:?}");
            }
        } else {
            // (A grant's `held` and `expires_at` were checked on the grant.)
            let on_grant = matches!(o.kind, OpKind::Reserve { .. }) && matches!(o.want, Want::Ok);
            let asked =
                o.status.is_some() || o.charged.is_some() || (o.held.is_some() && !on_grant);
            assert!(!asked, "{ctx}: no reservation to check");
        }
    }

    fn run_expect(&mut self, e: Exp, ctx: &str) {
        let key = ScopeKey::parse(e.scope).expect("a canonical scope");
        self.note_scope(&key);
        let st = self.ledger.status(self.now(), &key);
        if let Some(p) = e.plan {
            assert_eq!(st.plan, p, "{ctx}: plan");
        }
        let matching: Vec<&LimitStatus> = st
            .limits
            .iter()
            .filter(|l| l.dimension == e.dimension && e.window.is_none_or(|w| l.window.kind() == w))
            .collect();
        let [l] = matching[..] else {
            panic!("{ctx}: not exactly one such limit in {st:?}");
        };
        let got = (
            e.used.map(|_| l.used),
            e.held.map(|_| l.held),
            e.remaining.map(|_| l.remaining),
            e.resets_at.map(|_| l.resets_at.map(Timestamp::as_millis)),
        );
        assert_eq!(
            got,
            (e.used, e.held, e.remaining, e.resets_at),
            "{ctx}: {l:?}"
        );
    }

    fn run(&mut self, step: Step, ctx: &str) {
        match step {
            Step::At(ms) => self.now_ms = ms,
            Step::Advance(ms) => self.now_ms += ms,
            Step::Op(o) => self.run_op(o, ctx),
            Step::Expect(e) => self.run_expect(e, ctx),
            Step::Adjust {
                scope,
                dimension,
                credit,
                found,
            } => {
                let key = ScopeKey::parse(scope).unwrap();
                self.note_scope(&key);
                let dim = self.ledger.catalog().dimension(dimension).unwrap();
                let before = (!found).then(|| self.snapshot());
                let got = self.ledger.adjust(self.now(), &key, dim, credit);
                match (found, got) {
                    (true, Ok(_)) | (false, Err(AdminError::NotFound(_))) => {}
                    (_, got) => panic!("{ctx}: got {got:?}"),
                }
                if let Some(before) = before {
                    assert_eq!(before, self.snapshot(), "{ctx}: changed the ledger");
                }
            }
            Step::Admin(Admin(_, f)) => {
                self.ledger
                    .update_catalog(|c| {
                        f(c);
                        Ok::<(), ()>(())
                    })
                    .unwrap();
            }
            Step::ExpireDue(want) => {
                let n = self.ledger.expire_due(self.now());
                if let Some(w) = want {
                    assert_eq!(n, w, "{ctx}: expired so far");
                }
            }
            Step::Counts {
                scopes,
                reservations,
                held,
            } => {
                let l = &self.ledger;
                let got = (
                    scopes.map(|_| l.scope_count()),
                    reservations.map(|_| l.reservation_count()),
                    held.map(|_| l.held_count()),
                );
                assert_eq!(got, (scopes, reservations, held), "{ctx}: counts");
            }
        }
    }
}

/// Runs `steps` on a ledger configured by `setup`, checking the invariants
/// after every step.
fn check(setup: Setup, steps: Vec<Step>) {
    let mut w = World {
        ledger: Ledger::new(setup.0),
        now_ms: 0,
        ids: HashMap::new(),
        next_id: 0,
        scopes: Vec::new(),
    };
    for (i, step) in steps.into_iter().enumerate() {
        let ctx = format!("step {i} ({step:?}) at {} ms", w.now_ms);
        w.run(step, &ctx);
        if let Err(e) = w.ledger.check_invariants() {
            panic!("{ctx}: invariant broken: {e}");
        }
    }
}

use WindowKind::{Bucket, Calendar, Concurrent, Sliding, Total};

const T: &str = "tenant:t";

// ============================================================================
// sliding
// ============================================================================

/// Slices are aligned to the epoch (`floor(now / (period / slices))`), not
/// to the first use: usage at 10 999 ms sits in slice [10 000, 11 000) and
/// leaves at 14 000 ms, 3 001 ms later; then usage leaves slice by slice and
/// no instant resets the whole window.
#[test]
fn sliding_slices_align_to_the_epoch_and_leave_one_by_one() {
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 4000, 4)]),
        vec![
            at(10_999),
            reserve("r1", "t", &[], &[("tokens", 30)]),
            settle("r1", &[("tokens", 30)]),
            expect(T, "tokens")
                .used(30)
                .holding(0)
                .remaining(70)
                .resets_at(Some(14_000)),
            at(11_000),
            reserve("r2", "t", &[], &[("tokens", 50)]),
            settle("r2", &[("tokens", 50)]),
            expect(T, "tokens")
                .used(80)
                .remaining(20)
                .resets_at(Some(14_000)),
            at(13_999),
            expect(T, "tokens").used(80).resets_at(Some(14_000)),
            at(14_000),
            expect(T, "tokens")
                .used(50)
                .remaining(50)
                .resets_at(Some(15_000)),
            at(14_999),
            expect(T, "tokens").used(50),
            at(15_000),
            expect(T, "tokens").used(0).remaining(100).resets_at(None),
        ],
    );
}

/// `retry_after` is the time until enough slices leave that
/// `used ≤ capacity − held − requested`, holds assumed to stay; when holds
/// alone block, it is the earliest expiry of the scope's holds; more than
/// the capacity is never possible.
#[test]
fn sliding_retry_after_waits_for_the_needed_slice() {
    let deny = |requested, retry, remaining| {
        rate_limited(T, "tokens", retry).fields(Sliding, 100, remaining, requested, Some(14_000))
    };
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 4000, 4)]),
        vec![
            at(10_500),
            reserve("r1", "t", &[], &[("tokens", 30)]),
            settle("r1", &[("tokens", 30)]), // slice 10, leaves at 14 000
            at(11_200),
            reserve("r2", "t", &[], &[("tokens", 50)]),
            settle("r2", &[("tokens", 50)]), // slice 11, leaves at 15 000
            // used 80: 60 needs used ≤ 40, so both slices must leave.
            reserve("x", "t", &[], &[("tokens", 60)]).denied(deny(60, 3_800, 20)),
            // 30 needs used ≤ 70: slice 10 leaving is enough.
            reserve("x", "t", &[], &[("tokens", 30)]).denied(deny(30, 2_800, 20)),
            reserve("h", "t", &[], &[("tokens", 10)]).ttl(60_000),
            // With 10 held: 30 needs used ≤ 60 → 14 000; 41 needs ≤ 49 → 15 000.
            reserve("x", "t", &[], &[("tokens", 30)]).denied(deny(30, 2_800, 10)),
            reserve("x", "t", &[], &[("tokens", 41)]).denied(deny(41, 3_800, 10)),
            // 95 > 100 − 10: the hold alone blocks; it expires at 71 200.
            reserve("x", "t", &[], &[("tokens", 95)]).denied(deny(95, 60_000, 10)),
            reserve("x", "t", &[], &[("tokens", 101)]).denied(exceeds_limit(T, "tokens").fields(
                Sliding,
                100,
                10,
                101,
                Some(14_000),
            )),
            refund("h"),
            at(14_000),
            reserve("r3", "t", &[], &[("tokens", 50)]),
            expect(T, "tokens").used(50).holding(50).remaining(0),
        ],
    );
}

// ============================================================================
// bucket
// ============================================================================

const B0: u64 = 1_000_000;

/// A bucket starts full and refills continuously at capacity/period;
/// `remaining` rounds down; `retry_after = ⌈deficit / rate⌉` exactly (60 per
/// 60 s: 1 → 1 000 ms, 5 → 5 000 ms); `resets_at` is when it is full again.
#[test]
fn bucket_refills_continuously_and_retries_exactly() {
    let deny = |requested, retry| {
        rate_limited(T, "tokens", retry).fields(Bucket, 60, 0, requested, Some(B0 + 60_000))
    };
    check(
        setup().kind("tenant", vec![bucket("tokens", 60, 60_000)]),
        vec![
            at(B0),
            expect(T, "tokens").used(0).remaining(60).resets_at(None),
            reserve("r1", "t", &[], &[("tokens", 60)]),
            settle("r1", &[("tokens", 60)]),
            expect(T, "tokens")
                .used(60)
                .remaining(0)
                .resets_at(Some(B0 + 60_000)),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(deny(1, 1_000)),
            reserve("x", "t", &[], &[("tokens", 5)]).denied(deny(5, 5_000)),
            reserve("x", "t", &[], &[("tokens", 60)]).denied(deny(60, 60_000)),
            reserve("x", "t", &[], &[("tokens", 61)]).denied(exceeds_limit(T, "tokens")),
            // Half a token back: remaining still rounds down to 0.
            at(B0 + 500),
            expect(T, "tokens").used(60).remaining(0),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(T, "tokens", 500).fields(
                Bucket,
                60,
                0,
                1,
                Some(B0 + 60_000),
            )),
            at(B0 + 999),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(T, "tokens", 1)),
            at(B0 + 1_000),
            expect(T, "tokens")
                .used(59)
                .remaining(1)
                .resets_at(Some(B0 + 60_000)),
            at(B0 + 30_000),
            expect(T, "tokens").used(30).remaining(30),
            at(B0 + 60_000),
            expect(T, "tokens").used(0).remaining(60).resets_at(None),
            // Never above capacity, however long it waits.
            at(B0 + 600_000),
            expect(T, "tokens").used(0).remaining(60),
            // Holds that do not block alone: 40 used, 20 held; 5 more needs
            // used ≤ 60 − 20 − 5 = 35, i.e. 5 tokens of refill: 5 000 ms.
            reserve("r2", "t", &[], &[("tokens", 40)]),
            settle("r2", &[("tokens", 40)]),
            reserve("h", "t", &[], &[("tokens", 20)]).ttl(100_000),
            expect(T, "tokens")
                .used(40)
                .holding(20)
                .remaining(0)
                .resets_at(Some(B0 + 640_000)),
            reserve("x", "t", &[], &[("tokens", 5)]).denied(
                rate_limited(T, "tokens", 5_000).fields(Bucket, 60, 0, 5, Some(B0 + 640_000)),
            ),
            // 41 > 60 − 20: the hold alone blocks, until it expires.
            reserve("x", "t", &[], &[("tokens", 41)]).denied(rate_limited(T, "tokens", 100_000)),
        ],
    );
}

/// A fractional rate, 7 per 1 000 ms: a token takes 142.857… ms, so one
/// token is back after 143 ms (not 142), two after 286, three after 429.
#[test]
fn bucket_fractional_rate_rounds_the_wait_up() {
    check(
        setup().kind("tenant", vec![bucket("tokens", 7, 1_000)]),
        vec![
            at(5_000),
            reserve("r1", "t", &[], &[("tokens", 7)]),
            settle("r1", &[("tokens", 7)]),
            expect(T, "tokens")
                .used(7)
                .remaining(0)
                .resets_at(Some(6_000)),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(T, "tokens", 143)),
            reserve("x", "t", &[], &[("tokens", 2)]).denied(rate_limited(T, "tokens", 286)),
            reserve("x", "t", &[], &[("tokens", 3)]).denied(rate_limited(T, "tokens", 429)),
            reserve("x", "t", &[], &[("tokens", 7)]).denied(rate_limited(T, "tokens", 1_000)),
            at(5_142),
            expect(T, "tokens").used(7).remaining(0),
            at(5_143),
            expect(T, "tokens").used(6).remaining(1),
            // Level 1.001: a second token needs 0.999 more, 142.7 → 143 ms.
            reserve("x", "t", &[], &[("tokens", 2)]).denied(rate_limited(T, "tokens", 143)),
            at(6_000),
            expect(T, "tokens").used(0).remaining(7).resets_at(None),
        ],
    );
}

/// A hold is kept apart from the bucket's level: releasing it (refund or
/// expiry) after the bucket refilled never credits it above full.
#[test]
fn bucket_hold_never_over_credits_a_refilled_bucket() {
    check(
        setup().kind("tenant", vec![bucket("tokens", 60, 60_000)]),
        vec![
            at(B0),
            reserve("h1", "t", &[], &[("tokens", 20)]),
            expect(T, "tokens").used(0).holding(20).remaining(40),
            advance(10_000),
            refund("h1"),
            expect(T, "tokens").used(0).holding(0).remaining(60),
            // Half empty, then a hold of the rest; the bucket refills under it.
            reserve("r1", "t", &[], &[("tokens", 30)]),
            settle("r1", &[("tokens", 30)]),
            reserve("h2", "t", &[], &[("tokens", 20)]),
            expect(T, "tokens").used(30).holding(20).remaining(10),
            advance(30_000),
            expect(T, "tokens")
                .used(0)
                .holding(20)
                .remaining(40)
                .resets_at(None),
            refund("h2"),
            expect(T, "tokens").used(0).holding(0).remaining(60),
            // The same through an expiry.
            reserve("h3", "t", &[], &[("tokens", 60)]).ttl(1_000),
            expect(T, "tokens").used(0).holding(60).remaining(0),
            advance(1_000),
            get("h3").status(Status::Expired),
            expect(T, "tokens").used(0).holding(0).remaining(60),
        ],
    );
}

// ============================================================================
// calendar
// ============================================================================

const DAY_MS: u64 = 86_400_000;
/// 2026-01-07T15:30:00Z, a Wednesday.
const WED: u64 = 1_767_799_800_000;

/// UTC hour, day, week (Monday) and month: usage resets exactly at the
/// boundary, `retry_after` is the time to it, `resets_at` the next one.
#[test]
fn calendar_utc_units_reset_at_their_boundaries() {
    // (unit, the boundary after WED, the one after that), by `date -u`.
    let cases = [
        // 2026-01-07T16:00Z, 17:00Z
        (CalendarUnit::Hour, 1_767_801_600_000, 1_767_805_200_000),
        // 2026-01-08T00:00Z, 2026-01-09T00:00Z
        (CalendarUnit::Day, 1_767_830_400_000, 1_767_916_800_000),
        // Monday 2026-01-12T00:00Z, Monday 2026-01-19T00:00Z
        (CalendarUnit::Week, 1_768_176_000_000, 1_768_780_800_000),
        // 2026-02-01T00:00Z, 2026-03-01T00:00Z (28 days)
        (CalendarUnit::Month, 1_769_904_000_000, 1_772_323_200_000),
    ];
    for (unit, next, after) in cases {
        assert_eq!(window_bounds(unit, &Zone::utc(), WED).1, next, "{unit:?}");
        assert_eq!(window_bounds(unit, &Zone::utc(), next), (next, after));
        check(
            setup().kind("tenant", vec![calendar("tokens", 10, unit, "UTC")]),
            vec![
                at(WED),
                reserve("r1", "t", &[], &[("tokens", 10)]),
                settle("r1", &[("tokens", 10)]),
                expect(T, "tokens")
                    .used(10)
                    .remaining(0)
                    .resets_at(Some(next)),
                reserve("x", "t", &[], &[("tokens", 1)]).denied(
                    rate_limited(T, "tokens", next - WED).fields(Calendar, 10, 0, 1, Some(next)),
                ),
                at(next - 1),
                expect(T, "tokens").used(10),
                reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(T, "tokens", 1)),
                at(next),
                expect(T, "tokens")
                    .used(0)
                    .remaining(10)
                    .resets_at(Some(after)),
            ],
        );
    }
    // A leap February: 2024-02-01 → 2024-03-01 is 29 days.
    let feb = 1_706_745_600_000;
    assert_eq!(
        window_bounds(CalendarUnit::Month, &Zone::utc(), feb + 1),
        (feb, feb + 29 * DAY_MS)
    );
}

/// A day limit in a zone with DST resets at *local* midnight: the Paris day
/// of 2026-03-29 is 23 h long, that of 2026-10-25 25 h, New York's
/// 2026-03-08 23 h. (day start, day end, next day end), by `date`.
#[test]
fn calendar_local_days_across_dst_changes() {
    let cases = [
        // Paris, spring forward at 01:00Z: 00:00 CET = 23:00Z the day before.
        (
            "Europe/Paris",
            1_774_738_800_000,
            1_774_821_600_000,
            1_774_908_000_000,
            23,
        ),
        // Paris, fall back at 01:00Z: 00:00 CEST = 22:00Z the day before.
        (
            "Europe/Paris",
            1_792_879_200_000,
            1_792_969_200_000,
            1_793_055_600_000,
            25,
        ),
        // New York, spring forward at 07:00Z: 00:00 EST = 05:00Z.
        (
            "America/New_York",
            1_772_946_000_000,
            1_773_028_800_000,
            1_773_115_200_000,
            23,
        ),
    ];
    for (zone, start, end, next_end, hours) in cases {
        let z = Zone::named(zone).unwrap();
        assert_eq!(end - start, hours * 3_600_000, "{zone}");
        assert_eq!(
            window_bounds(CalendarUnit::Day, &z, start + 1),
            (start, end)
        );
        // The DST change happens 2 h (spring) or 3 h (Paris autumn) into
        // the day; settle before it, look again after it.
        let before_jump = start + 3_600_000 - 1;
        check(
            setup().kind(
                "tenant",
                vec![calendar("tokens", 10, CalendarUnit::Day, zone)],
            ),
            vec![
                // The last half hour of the day before: resets at `start`.
                at(start - 1_800_000),
                reserve("r0", "t", &[], &[("tokens", 10)]),
                settle("r0", &[("tokens", 10)]),
                expect(T, "tokens").used(10).resets_at(Some(start)),
                reserve("x", "t", &[], &[("tokens", 1)])
                    .denied(rate_limited(T, "tokens", 1_800_000)),
                at(start),
                expect(T, "tokens")
                    .used(0)
                    .remaining(10)
                    .resets_at(Some(end)),
                at(before_jump),
                reserve("r1", "t", &[], &[("tokens", 10)]),
                settle("r1", &[("tokens", 10)]),
                reserve("x", "t", &[], &[("tokens", 1)]).denied(
                    rate_limited(T, "tokens", end - before_jump).fields(
                        Calendar,
                        10,
                        0,
                        1,
                        Some(end),
                    ),
                ),
                // Across the jump: the same day.
                at(start + 4 * 3_600_000),
                expect(T, "tokens").used(10).resets_at(Some(end)),
                at(end - 1),
                expect(T, "tokens").used(10),
                at(end),
                expect(T, "tokens")
                    .used(0)
                    .remaining(10)
                    .resets_at(Some(next_end)),
            ],
        );
    }
}

/// At the epoch itself (now = 0) a calendar window is set up like at any
/// other instant: usage at 0 ms stays in the first minute.
#[test]
fn calendar_window_at_the_epoch() {
    check(
        setup().kind(
            "tenant",
            vec![calendar("tokens", 10, CalendarUnit::Minute, "UTC")],
        ),
        vec![
            at(0),
            reserve("r", "t", &[], &[("tokens", 10)]),
            settle("r", &[("tokens", 10)]),
            expect(T, "tokens").used(10).resets_at(Some(60_000)),
            at(59_999),
            expect(T, "tokens").used(10),
            at(60_000),
            expect(T, "tokens").used(0),
        ],
    );
}

// ============================================================================
// total
// ============================================================================

/// A total never refills. A refusal because usage alone leaves no room
/// (`requested > capacity − used`) is `budget_exhausted` (no retry, no
/// reset); otherwise holds block and it is `rate_limited` until the
/// earliest hold holding the dimension expires, which is also its
/// `resets_at`; only an admin credit (+) or debit (−) changes it.
#[test]
fn total_never_refills_and_only_an_admin_changes_it() {
    let exhausted = |requested, remaining| {
        budget_exhausted(T, "cost_micros").fields(Total, 1000, remaining, requested, None)
    };
    check(
        setup().kind("tenant", vec![total("cost_micros", 1000)]),
        vec![
            at(1_000),
            reserve("r1", "t", &[], &[("cost_micros", 600)]).ttl(5_000),
            expect(T, "cost_micros")
                .used(0)
                .holding(600)
                .remaining(400)
                .resets_at(None),
            // 500 > 1000 − 600: the hold alone blocks; it expires at 6 000.
            reserve("x", "t", &[], &[("cost_micros", 500)]).denied(
                rate_limited(T, "cost_micros", 5_000).fields(Total, 1000, 400, 500, Some(6_000)),
            ),
            settle("r1", &[("cost_micros", 700)]),
            expect(T, "cost_micros").used(700).holding(0).remaining(300),
            reserve("x", "t", &[], &[("cost_micros", 400)]).denied(exhausted(400, 300)),
            // Ten years later: still spent.
            advance(10 * 365 * DAY_MS),
            expect(T, "cost_micros").used(700).remaining(300),
            reserve("h", "t", &[], &[("cost_micros", 300)]).ttl(10_000),
            // 1 ≤ 1000 − 700 used: the hold's end frees room for it.
            reserve("x", "t", &[], &[("cost_micros", 1)]).denied(rate_limited(
                T,
                "cost_micros",
                10_000,
            )),
            // 301 > 1000 − 700 used: the hold's end cannot help.
            reserve("x", "t", &[], &[("cost_micros", 301)]).denied(exhausted(301, 0)),
            refund("h"),
            adjust(T, "cost_micros", 500),
            expect(T, "cost_micros").used(200).remaining(800),
            adjust(T, "cost_micros", -300),
            expect(T, "cost_micros").used(500).remaining(500),
            adjust(T, "tokens", 10).not_found(),
            reserve("r2", "t", &[], &[("cost_micros", 500)]),
            settle("r2", &[("cost_micros", 500)]),
            expect(T, "cost_micros").used(1000).remaining(0),
            // Engine's choice: a credit larger than the usage takes `used`
            // below zero (remaining above capacity) rather than clamping.
            adjust(T, "cost_micros", 1200),
            expect(T, "cost_micros").used(-200).remaining(1200),
        ],
    );
}

// ============================================================================
// concurrent
// ============================================================================

/// At most `capacity` HELD reservations; `held` counts them; `used` is
/// always 0; a refusal retries at the earliest expiry of *that scope's*
/// holds; `resets_at` is that expiry, `None` when nothing is held.
#[test]
fn concurrent_counts_held_reservations() {
    check(
        setup()
            .kind("tenant", vec![concurrent(2)])
            .kind("agent", vec![concurrent(1)]),
        vec![
            at(1_000),
            reserve("r1", "t", &[], &[("tokens", 50)]).ttl(5_000),
            reserve("r2", "t", &[], &[]).ttl(3_000),
            expect(T, "concurrent")
                .used(0)
                .holding(2)
                .remaining(0)
                .resets_at(Some(4_000)),
            reserve("x", "t", &[], &[]).denied(rate_limited(T, "concurrent", 3_000).fields(
                Concurrent,
                2,
                0,
                1,
                Some(4_000),
            )),
            settle("r2", &[]),
            expect(T, "concurrent")
                .used(0)
                .holding(1)
                .remaining(1)
                .resets_at(Some(6_000)),
            settle("r1", &[("tokens", 50)]),
            expect(T, "concurrent")
                .used(0)
                .holding(0)
                .remaining(2)
                .resets_at(None),
            // Two agents: a2's hold ends first, but a1's own hold binds a1.
            reserve("a2", "t", &[("agent", "a2")], &[]).ttl(1_000),
            reserve("a1", "t", &[("agent", "a1")], &[]).ttl(9_000),
            // Both the tenant (retry 1 000) and a1 (retry 9 000) refuse;
            // the latest retry is reported.
            reserve("x", "t", &[("agent", "a1")], &[]).denied(rate_limited(
                "tenant:t/agent:a1",
                "concurrent",
                9_000,
            )),
            advance(1_000),
            expect(T, "concurrent").holding(1).resets_at(Some(10_000)),
            expect("tenant:t/agent:a2", "concurrent")
                .holding(0)
                .resets_at(None),
            reserve("a3", "t", &[("agent", "a2")], &[]),
            expect(T, "concurrent").holding(2).remaining(0),
        ],
    );
}

// ============================================================================
// holds and usage
// ============================================================================

/// 2026-01-01T01:00:00Z; that UTC day ends at 2026-01-02T00:00:00Z.
const H0: u64 = 1_767_229_200_000;
const H0_DAY_END: u64 = 1_767_312_000_000;

/// For every window kind at once: a hold counts in full and apart from
/// usage; a refund and an expiry record nothing (not even `requests`); a
/// late settle records the usage and `requests` = 1 once, at the settle
/// time; usage enters windows only at settle, at the settle time.
#[test]
fn holds_are_kept_apart_from_usage_in_every_window() {
    let kinds = [Sliding, Bucket, Calendar, Total];
    let tokens = |steps: &mut Vec<Step>, used: [i64; 4], held: u64| {
        for (w, u) in kinds.into_iter().zip(used) {
            steps.push(
                expect(T, "tokens")
                    .window(w)
                    .used(u)
                    .holding(held)
                    .remaining(1000 - u - held as i64),
            );
        }
    };
    let mut s = vec![at(H0), reserve("r1", "t", &[], &[("tokens", 400)])];
    tokens(&mut s, [0; 4], 400);
    s.push(expect(T, "requests").used(0).holding(1).remaining(9));
    s.push(expect(T, "concurrent").holding(1).remaining(4));
    // A refund records nothing, not even the request.
    s.push(refund("r1").status(Status::Refunded));
    tokens(&mut s, [0; 4], 0);
    s.push(expect(T, "requests").used(0).holding(0));
    s.push(expect(T, "concurrent").holding(0));
    // An expiry records nothing either.
    s.push(reserve("r2", "t", &[], &[("tokens", 300)]).ttl(1_000));
    s.push(advance(1_000));
    s.push(get("r2").status(Status::Expired));
    tokens(&mut s, [0; 4], 0);
    s.push(expect(T, "requests").used(0).holding(0));
    // A late settle records its usage and one request, at the settle time.
    s.push(at(H0 + 5_000));
    s.push(
        settle("r2", &[("tokens", 200)])
            .status(Status::Settled)
            .late(true)
            .charged(&[("tokens", 200)]),
    );
    tokens(&mut s, [200; 4], 0);
    s.push(expect(T, "requests").used(1).holding(0));
    s.push(
        expect(T, "tokens")
            .window(Sliding)
            .resets_at(Some(H0 + 65_000)),
    );
    // 200 tokens at 1000 per 60 s refill in 12 s.
    s.push(
        expect(T, "tokens")
            .window(Bucket)
            .resets_at(Some(H0 + 17_000)),
    );
    s.push(
        expect(T, "tokens")
            .window(Calendar)
            .resets_at(Some(H0_DAY_END)),
    );
    s.push(expect(T, "tokens").window(Total).resets_at(None));
    // A repeat settle answers the same and records nothing more.
    s.push(
        settle("r2", &[("tokens", 999)])
            .late(true)
            .charged(&[("tokens", 200)]),
    );
    s.push(expect(T, "requests").used(1));
    tokens(&mut s, [200; 4], 0);
    // Reserved at H0 + 5 000 but settled at H0 + 20 000: the sliding usage
    // sits in the settle's slice and outlives r2's.
    s.push(reserve("r3", "t", &[], &[("tokens", 100)]));
    s.push(at(H0 + 20_000));
    s.push(settle("r3", &[("tokens", 100)]).late(false));
    // The bucket had refilled 250 ≥ 200 by then: it holds only r3's 100.
    tokens(&mut s, [300, 100, 300, 300], 0);
    s.push(
        expect(T, "tokens")
            .window(Bucket)
            .resets_at(Some(H0 + 26_000)),
    );
    s.push(expect(T, "requests").used(2));
    s.push(at(H0 + 65_000));
    s.push(
        expect(T, "tokens")
            .window(Sliding)
            .used(100)
            .resets_at(Some(H0 + 80_000)),
    );
    s.push(expect(T, "requests").used(1));
    check(
        setup().kind(
            "tenant",
            vec![
                sliding("tokens", 1000, 60_000, 60),
                bucket("tokens", 1000, 60_000),
                calendar("tokens", 1000, CalendarUnit::Day, "UTC"),
                total("tokens", 1000),
                sliding("requests", 10, 60_000, 60),
                concurrent(5),
            ],
        ),
        s,
    );
}

// ============================================================================
// denials
// ============================================================================

/// exceeds_limit over budget_exhausted over rate_limited; among
/// rate_limited the latest retry; every field of the denial.
#[test]
fn denial_precedence_by_kind_then_latest_retry() {
    const A1: &str = "tenant:t/agent:a1";
    check(
        setup()
            .kind(
                "tenant",
                vec![
                    sliding("tokens", 2000, 60_000, 60),
                    total("cost_micros", 100),
                ],
            )
            // 500 per 600 s: one token per 1 200 ms.
            .kind("agent", vec![bucket("tokens", 500, 600_000)]),
        vec![
            at(100_000),
            reserve(
                "r0",
                "t",
                &[("agent", "a1")],
                &[("tokens", 10), ("cost_micros", 100)],
            ),
            settle("r0", &[("tokens", 1470), ("cost_micros", 100)]),
            reserve("r1", "t", &[("agent", "a3")], &[("tokens", 10)]),
            settle("r1", &[("tokens", 470)]),
            expect(T, "tokens").used(1940).remaining(60),
            expect(A1, "tokens").used(1470).remaining(-970),
            // All three kinds refuse 600 tokens and 1 micro: exceeds wins.
            reserve(
                "x",
                "t",
                &[("agent", "a2")],
                &[("tokens", 600), ("cost_micros", 1)],
            )
            .denied(
                exceeds_limit("tenant:t/agent:a2", "tokens").fields(Bucket, 500, 500, 600, None),
            ),
            // budget_exhausted over rate_limited (61 tokens: the tenant's sliding).
            reserve(
                "x",
                "t",
                &[("agent", "a2")],
                &[("tokens", 61), ("cost_micros", 1)],
            )
            .denied(budget_exhausted(T, "cost_micros").fields(Total, 100, 0, 1, None)),
            // a3 (retry 31 × 1 200 = 37 200 ms) and the tenant (its slice
            // leaves at 160 000: 60 000 ms) refuse: the later one is reported.
            reserve("x", "t", &[("agent", "a3")], &[("tokens", 61)]).denied(
                rate_limited(T, "tokens", 60_000).fields(Sliding, 2000, 60, 61, Some(160_000)),
            ),
            // a1 needs 1 470 − 439 = 1 031 tokens back: 1 237 200 ms.
            reserve("x", "t", &[("agent", "a1")], &[("tokens", 61)]).denied(
                rate_limited(A1, "tokens", 1_237_200).fields(
                    Bucket,
                    500,
                    -970,
                    61,
                    Some(100_000 + 1470 * 1200),
                ),
            ),
        ],
    );
}

/// Equal retries: the earlier scope wins (the tenant first, then the order
/// of the request), then the earlier limit of the plan.
#[test]
fn denial_ties_go_to_the_earlier_scope_then_limit() {
    check(
        setup()
            .kind("tenant", vec![concurrent(1)])
            .kind("agent", vec![concurrent(1)])
            .kind("user", vec![concurrent(1)]),
        vec![
            reserve("r", "t", &[("agent", "a"), ("user", "u")], &[]).ttl(10_000),
            reserve("x", "t", &[("agent", "a"), ("user", "u")], &[]).denied(rate_limited(
                T,
                "concurrent",
                10_000,
            )),
        ],
    );
    check(
        setup()
            .kind("tenant", vec![concurrent(5)])
            .kind("agent", vec![concurrent(1)])
            .kind("user", vec![concurrent(1)]),
        vec![
            reserve("r", "t", &[("agent", "a"), ("user", "u")], &[]).ttl(10_000),
            reserve("x", "t", &[("agent", "a"), ("user", "u")], &[]).denied(rate_limited(
                "tenant:t/agent:a",
                "concurrent",
                10_000,
            )),
            reserve("x", "t", &[("user", "u"), ("agent", "a")], &[]).denied(rate_limited(
                "tenant:t/user:u",
                "concurrent",
                10_000,
            )),
        ],
    );
    // Two calendar limits refusing until the same midnight: the first in
    // the plan is reported; reversing the plan (history kept) reverses it.
    let next = 1_767_830_400_000;
    let day = |dim, cap| calendar(dim, cap, CalendarUnit::Day, "UTC");
    check(
        setup().kind("tenant", vec![day("requests", 1), day("tokens", 10)]),
        vec![
            at(WED),
            reserve("r", "t", &[], &[("tokens", 10)]),
            settle("r", &[("tokens", 10)]),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(
                T,
                "requests",
                next - WED,
            )),
            set_plan(
                "tenant",
                OverrunPolicy::ChargeActual,
                vec![day("tokens", 10), day("requests", 1)],
            ),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(T, "tokens", next - WED)),
        ],
    );
}

/// A dry run answers exactly what a reserve would, and changes nothing.
#[test]
fn dry_run_answers_like_a_reserve_and_changes_nothing() {
    check(
        setup().kind(
            "tenant",
            vec![sliding("tokens", 100, 60_000, 60), concurrent(1)],
        ),
        vec![
            at(1_000),
            reserve("d", "t", &[], &[("tokens", 100)])
                .dry_run()
                .held(&[("tokens", 100)])
                .expires_at(301_000),
            expect(T, "tokens").used(0).holding(0).remaining(100),
            expect(T, "concurrent").holding(0),
            reserve("r", "t", &[], &[("tokens", 60)]).ttl(10_000),
            reserve("d", "t", &[], &[("tokens", 10)])
                .dry_run()
                .denied(rate_limited(T, "concurrent", 10_000)),
        ],
    );
}

// ============================================================================
// overrun policies
// ============================================================================

/// charge_actual records the actual: remaining goes negative and later
/// reserves are refused until the window frees.
#[test]
fn charge_actual_may_go_negative() {
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 60_000, 60)]),
        vec![
            at(1_000),
            reserve("r", "t", &[], &[("tokens", 50)]),
            settle("r", &[("tokens", 150)]).charged(&[("tokens", 150)]),
            expect(T, "tokens").used(150).remaining(-50),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(
                rate_limited(T, "tokens", 60_000).fields(Sliding, 100, -50, 1, Some(61_000)),
            ),
            at(61_000),
            expect(T, "tokens").used(0).remaining(100),
            reserve("y", "t", &[], &[("tokens", 100)]),
        ],
    );
}

fn metered(policy: OverrunPolicy) -> Setup {
    setup().kind_with(
        "tenant",
        policy,
        vec![
            sliding("tokens", 100, 60_000, 60),
            total("input_tokens", 1000),
            total("output_tokens", 1000),
            total("cost_micros", 10_000),
            total("search_calls", 10),
        ],
    )
}

/// cap_at_estimate records min(actual, held) per dimension, then derives
/// `tokens` again; tool charges are never capped.
#[test]
fn cap_at_estimate_caps_each_dimension_but_not_tool_charges() {
    check(
        metered(OverrunPolicy::CapAtEstimate),
        vec![
            reserve(
                "r",
                "t",
                &[],
                &[("input_tokens", 30), ("output_tokens", 20)],
            )
            .held(&[("input_tokens", 30), ("output_tokens", 20), ("tokens", 50)]),
            settle("r", &[("input_tokens", 100), ("output_tokens", 10)])
                .charge("search", 500, &[("search_calls", 2)])
                .charged(&[
                    ("input_tokens", 30),
                    ("output_tokens", 10),
                    ("tokens", 40),
                    ("cost_micros", 500),
                    ("search_calls", 2),
                ]),
            expect(T, "tokens").used(40),
            expect(T, "input_tokens").used(30),
            expect(T, "cost_micros").used(500),
            expect(T, "search_calls").used(2),
        ],
    );
}

/// allow_overrun(10): floor(held × 110 / 100) per dimension (33 → 36,
/// 7 → 7), tokens derived again (43), usage under the cap recorded as is.
#[test]
fn allow_overrun_caps_at_floor_of_held_plus_percent() {
    check(
        metered(OverrunPolicy::AllowOverrun { percent: 10 }),
        vec![
            reserve("r", "t", &[], &[("input_tokens", 33), ("output_tokens", 7)]),
            settle("r", &[("input_tokens", 100), ("output_tokens", 100)])
                .charge("search", 250, &[])
                .charged(&[
                    ("input_tokens", 36),
                    ("output_tokens", 7),
                    ("tokens", 43),
                    ("cost_micros", 250),
                ]),
            expect(T, "tokens").used(43),
            reserve("r2", "t", &[], &[("input_tokens", 33)]),
            settle("r2", &[("input_tokens", 20)]).charged(&[("input_tokens", 20), ("tokens", 20)]),
            expect(T, "input_tokens").used(56),
        ],
    );
}

/// The tenant's plan governs the whole reservation (one `charged` for all
/// scopes), and the policy is fixed at reserve time: a plan change does
/// not alter a live reservation's promise.
#[test]
fn the_tenant_policy_at_reserve_time_governs() {
    const A: &str = "tenant:t/agent:a";
    let tokens = || vec![sliding("tokens", 1000, 60_000, 60)];
    check(
        setup()
            .kind_with("tenant", OverrunPolicy::ChargeActual, tokens())
            .kind_with("agent", OverrunPolicy::CapAtEstimate, tokens()),
        vec![
            reserve("r", "t", &[("agent", "a")], &[("tokens", 50)]),
            settle("r", &[("tokens", 80)]).charged(&[("tokens", 80)]),
            expect(A, "tokens").used(80),
            expect(T, "tokens").used(80),
        ],
    );
    check(
        setup()
            .kind_with("tenant", OverrunPolicy::CapAtEstimate, tokens())
            .kind_with("agent", OverrunPolicy::ChargeActual, tokens()),
        vec![
            reserve("r1", "t", &[("agent", "a")], &[("tokens", 50)]),
            settle("r1", &[("tokens", 80)]).charged(&[("tokens", 50)]),
            expect(A, "tokens").used(50),
            // Promised under cap_at_estimate, settled under charge_actual.
            reserve("r2", "t", &[], &[("tokens", 50)]),
            set_plan("tenant", OverrunPolicy::ChargeActual, tokens()),
            settle("r2", &[("tokens", 80)]).charged(&[("tokens", 50)]),
            // And the other way round.
            reserve("r3", "t", &[], &[("tokens", 50)]),
            set_plan("tenant", OverrunPolicy::CapAtEstimate, tokens()),
            settle("r3", &[("tokens", 80)]).charged(&[("tokens", 80)]),
            expect(T, "tokens").used(180),
        ],
    );
}

/// A late settle under cap_at_estimate caps at what was held when it
/// expired (the estimate as last extended).
#[test]
fn late_settle_caps_at_the_hold_when_it_expired() {
    check(
        setup().kind_with(
            "tenant",
            OverrunPolicy::CapAtEstimate,
            vec![sliding("tokens", 1000, 60_000, 60)],
        ),
        vec![
            at(1_000),
            reserve("r", "t", &[], &[("tokens", 50)]).ttl(1_000),
            extend("r", Some(&[("tokens", 20)]), None).held(&[("tokens", 70)]),
            advance(1_000),
            get("r").status(Status::Expired),
            advance(5_000),
            settle("r", &[("tokens", 100)])
                .late(true)
                .charged(&[("tokens", 70)]),
            expect(T, "tokens").used(70).holding(0),
        ],
    );
}

// ============================================================================
// plan changes and overrides
// ============================================================================

/// A plan change is effective on the next operation; history is kept where
/// (dimension, window, period) is unchanged, a new limit starts empty, a
/// changed period starts empty, and holds carry over.
#[test]
fn plan_change_keeps_history_where_the_window_is_unchanged() {
    let cc = OverrunPolicy::ChargeActual;
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 60_000, 60)]),
        vec![
            at(1_000),
            reserve("r", "t", &[], &[("tokens", 80)]),
            settle("r", &[("tokens", 80)]),
            reserve("h", "t", &[], &[("tokens", 10)]),
            expect(T, "tokens").used(80).holding(10).remaining(10),
            set_plan(
                "tenant",
                cc,
                vec![
                    bucket("tokens", 50, 60_000),
                    sliding("tokens", 200, 60_000, 60),
                ],
            ),
            expect(T, "tokens")
                .window(Sliding)
                .used(80)
                .holding(10)
                .remaining(110)
                .resets_at(Some(61_000)),
            expect(T, "tokens")
                .window(Bucket)
                .used(0)
                .holding(10)
                .remaining(40),
            // The bucket is consulted from now on.
            // 41 > 50 − 10: h alone blocks the bucket until 301 000.
            reserve("x", "t", &[], &[("tokens", 41)]).denied(rate_limited(T, "tokens", 300_000)),
            set_plan("tenant", cc, vec![sliding("tokens", 200, 120_000, 60)]),
            expect(T, "tokens").used(0).holding(10).remaining(190),
            refund("h"),
            expect(T, "tokens").holding(0).remaining(200),
        ],
    );
    // The same period with other slices is the same window (SEMANTICS:
    // dimension, window, period): its history is kept, cut into the new
    // slices (ENGINE-CHOICES "Plans"), once a write moves the scope.
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 60_000, 60)]),
        vec![
            reserve("r", "t", &[], &[("tokens", 80)]),
            settle("r", &[("tokens", 80)]),
            set_plan("tenant", cc, vec![sliding("tokens", 100, 60_000, 30)]),
            expect(T, "tokens").used(80).remaining(20),
            reserve("x", "t", &[], &[("tokens", 21)]).denied(rate_limited(T, "tokens", 60_000)),
        ],
    );
}

/// A per-scope override moves one scope to another plan (or its own limits)
/// from the next operation; clearing it returns the scope to its kind's
/// plan, with the history of unchanged windows kept.
#[test]
fn overrides_are_set_and_cleared_per_scope() {
    const A: &str = "tenant:t/agent:a";
    const B: &str = "tenant:t/agent:b";
    let w = || sliding("tokens", 100, 60_000, 60);
    check(
        setup()
            .kind("agent", vec![w()])
            .plan("big", vec![sliding("tokens", 1000, 60_000, 60)]),
        vec![
            reserve("r", "t", &[("agent", "a")], &[("tokens", 70)]),
            settle("r", &[("tokens", 70)]),
            override_plan(A, "big"),
            expect(A, "tokens").on_plan("big").used(70).remaining(930),
            expect(B, "tokens").on_plan("agent").remaining(100),
            reserve("r2", "t", &[("agent", "a")], &[("tokens", 200)]),
            settle("r2", &[("tokens", 200)]),
            clear_override(A),
            expect(A, "tokens")
                .on_plan("agent")
                .used(270)
                .remaining(-170),
            override_limits(B, vec![total("tokens", 5)]),
            expect(B, "tokens").on_plan("own").remaining(5),
            reserve("x", "t", &[("agent", "b")], &[("tokens", 6)])
                .denied(exceeds_limit(B, "tokens").fields(Total, 5, 5, 6, None)),
        ],
    );
}

/// A calendar limit added by a plan change starts its window at once: usage
/// settled in the same millisecond as the scope's previous operation is
/// counted, and `resets_at` is the next boundary, not the epoch. (This was a
/// bug: the new window had no end until the clock moved, so the usage was
/// dropped one millisecond later and `resets_at` read 1970.)
#[test]
fn calendar_added_by_a_plan_change_counts_usage_at_once() {
    let next = 1_767_830_400_000;
    let cc = OverrunPolicy::ChargeActual;
    let minute = sliding("tokens", 100, 60_000, 60);
    check(
        setup().kind("tenant", vec![minute.clone()]),
        vec![
            at(WED),
            reserve("r", "t", &[], &[("tokens", 10)]),
            settle("r", &[("tokens", 10)]),
            set_plan(
                "tenant",
                cc,
                vec![minute, calendar("tokens", 10, CalendarUnit::Day, "UTC")],
            ),
            expect(T, "tokens")
                .window(Calendar)
                .used(0)
                .resets_at(Some(next)),
            reserve("r2", "t", &[], &[("tokens", 10)]),
            settle("r2", &[("tokens", 10)]),
            expect(T, "tokens")
                .window(Calendar)
                .used(10)
                .resets_at(Some(next)),
            advance(1),
            expect(T, "tokens").window(Calendar).used(10).remaining(0),
            reserve("x", "t", &[], &[("tokens", 1)]).denied(rate_limited(
                T,
                "tokens",
                next - WED - 1,
            )),
        ],
    );
}

// ============================================================================
// models
// ============================================================================

/// A priced model derives `cost_micros` from the token amounts, rounded up
/// once per operation; an unpriced model in a scope limiting `cost_micros`
/// is invalid (field `model`) unless the cost is given.
#[test]
fn model_prices_derive_cost_rounded_up() {
    check(
        setup()
            .kind("tenant", vec![total("cost_micros", 1_000_000)])
            .model("gpt", 2_500_000, 1_250_000, 10_000_000),
        vec![
            reserve(
                "r1",
                "t",
                &[],
                &[("input_tokens", 3000), ("output_tokens", 1000)],
            )
            .model("gpt")
            .held(&[
                ("input_tokens", 3000),
                ("output_tokens", 1000),
                ("tokens", 4000),
                ("cost_micros", 17_500),
            ]),
            // 2.5 micros → 3.
            reserve("r2", "t", &[], &[("input_tokens", 1)])
                .model("gpt")
                .held(&[("input_tokens", 1), ("tokens", 1), ("cost_micros", 3)]),
            expect(T, "cost_micros").holding(17_503),
            // 2 000 × 2.5 + 1 000 × 1.25 + 500 × 10 = 11 250.
            settle("r1", &[("input_tokens", 3000), ("output_tokens", 500)])
                .cached(1000)
                .charged(&[
                    ("input_tokens", 3000),
                    ("output_tokens", 500),
                    ("tokens", 3500),
                    ("cost_micros", 11_250),
                ]),
            // 2.5 + 1.25 = 3.75 → 4, rounded once (not 3 + 2).
            settle("r2", &[("input_tokens", 2)]).cached(1).charged(&[
                ("input_tokens", 2),
                ("tokens", 2),
                ("cost_micros", 4),
            ]),
            expect(T, "cost_micros").used(11_254).holding(0),
            reserve("x", "t", &[], &[("input_tokens", 10)])
                .model("mystery")
                .invalid("model"),
            reserve("r3", "t", &[], &[("input_tokens", 10), ("cost_micros", 50)])
                .model("mystery")
                .held(&[("input_tokens", 10), ("tokens", 10), ("cost_micros", 50)]),
        ],
    );
    // Where no scope limits cost, an unpriced model holds no cost.
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 60_000, 60)]),
        vec![
            reserve("r", "t", &[], &[("input_tokens", 10)])
                .model("mystery")
                .held(&[("input_tokens", 10), ("tokens", 10)]),
        ],
    );
}

// ============================================================================
// extend
// ============================================================================

/// extend raises a hold all or nothing (a refusal leaves it HELD exactly as
/// it was, on every scope), `ttl_ms` sets `expires_at = now + ttl_ms`, and
/// only a HELD reservation can be extended.
#[test]
fn extend_raises_all_or_nothing_and_pushes_expiry() {
    const A: &str = "tenant:t/agent:a";
    check(
        setup()
            .kind("tenant", vec![sliding("tokens", 100, 60_000, 60)])
            .kind(
                "agent",
                vec![sliding("tokens", 60, 60_000, 60), concurrent(1)],
            ),
        vec![
            at(1_000),
            reserve("r1", "t", &[("agent", "a")], &[("tokens", 30)]).ttl(10_000),
            extend("r1", Some(&[("tokens", 20)]), None)
                .held(&[("tokens", 50)])
                .expires_at(11_000),
            expect(T, "tokens").holding(50),
            expect(A, "tokens").holding(50),
            // The tenant has room for 20 more, the agent does not: with its
            // own 50 the reservation would hold 70 of 60, which it never
            // can (exceeds_limit, requested = the whole hold; a retry at
            // its own expiry would find it ended). Nothing changes anywhere.
            extend("r1", Some(&[("tokens", 20)]), None)
                .denied(exceeds_limit(A, "tokens").fields(Sliding, 60, 10, 70, None))
                .status(Status::Held)
                .held(&[("tokens", 50)])
                .expires_at(11_000),
            expect(T, "tokens").holding(50),
            at(5_000),
            extend("r1", None, Some(20_000)).expires_at(25_000),
            // Both at once; the concurrent gauge (full) is not asked again.
            extend("r1", Some(&[("tokens", 5)]), Some(1_000))
                .held(&[("tokens", 55)])
                .expires_at(6_000),
            at(6_000),
            get("r1").status(Status::Expired),
            extend("r1", None, Some(1_000)).not_held(Status::Expired),
            reserve("r2", "t", &[("agent", "b")], &[("tokens", 1)]),
            settle("r2", &[("tokens", 1)]),
            extend("r2", None, Some(1_000)).not_held(Status::Settled),
            reserve("r3", "t", &[("agent", "b")], &[("tokens", 1)]),
            refund("r3"),
            extend("r3", Some(&[("tokens", 1)]), None).not_held(Status::Refunded),
            extend("nobody", None, Some(1_000)).not_found(),
        ],
    );
}

// ============================================================================
// idempotency and retention
// ============================================================================

/// The same key and request answers the existing reservation (whatever its
/// status) and holds nothing new; a different request is a conflict; a
/// denied attempt binds no key; keys are forgotten after the retention.
#[test]
fn idempotency_keys_replay_conflict_and_expire() {
    let settings = Settings {
        idempotency_retention_ms: 10_000,
        ended_retention_ms: 5_000,
        ..Settings::default()
    };
    check(
        setup_with(settings)
            .kind("tenant", vec![sliding("tokens", 100, 600_000, 60)])
            .kind("agent", vec![])
            .kind("user", vec![])
            .model("gpt", 1_000_000, 1_000_000, 1_000_000),
        vec![
            at(1_000),
            reserve(
                "r1",
                "t",
                &[("agent", "a"), ("user", "u")],
                &[("tokens", 40)],
            )
            .key("k1")
            .ttl(30_000),
            // Another ttl, scopes in another order: the same request.
            reserve(
                "r1",
                "t",
                &[("user", "u"), ("agent", "a")],
                &[("tokens", 40)],
            )
            .key("k1")
            .ttl(50_000)
            .replays("r1")
            .status(Status::Held)
            .expires_at(31_000),
            expect(T, "tokens").holding(40),
            reserve(
                "x",
                "t",
                &[("agent", "a"), ("user", "u")],
                &[("tokens", 41)],
            )
            .key("k1")
            .conflict(),
            reserve(
                "x",
                "t",
                &[("agent", "b"), ("user", "u")],
                &[("tokens", 40)],
            )
            .key("k1")
            .conflict(),
            reserve("x", "t", &[("agent", "a")], &[("tokens", 40)])
                .key("k1")
                .conflict(),
            reserve(
                "x",
                "t",
                &[("agent", "a"), ("user", "u")],
                &[("tokens", 40)],
            )
            .key("k1")
            .model("gpt")
            .conflict(),
            // Another tenant's key space is its own.
            reserve("o1", "other", &[("agent", "a")], &[("tokens", 5)]).key("k1"),
            at(2_000),
            settle("r1", &[("tokens", 35)]),
            reserve(
                "r1",
                "t",
                &[("agent", "a"), ("user", "u")],
                &[("tokens", 40)],
            )
            .key("k1")
            .replays("r1")
            .status(Status::Settled),
            expect(T, "tokens").used(35).holding(0),
            // A denied attempt binds no key.
            reserve("x", "t", &[], &[("tokens", 90)])
                .key("k2")
                .denied(rate_limited(T, "tokens", 598_000)),
            reserve("k2", "t", &[], &[("tokens", 60)]).key("k2"),
            refund("k2"),
            // r1 ended at 2 000; its key is kept 10 000 ms.
            at(11_999),
            reserve(
                "r1",
                "t",
                &[("agent", "a"), ("user", "u")],
                &[("tokens", 40)],
            )
            .key("k1")
            .replays("r1"),
            at(12_000),
            get("r1").gone(),
            reserve(
                "r1new",
                "t",
                &[("agent", "a"), ("user", "u")],
                &[("tokens", 41)],
            )
            .key("k1"),
        ],
    );
}

/// An ended reservation is answered for `ended_retention_ms`, then
/// forgotten (`get` → None, settle/refund → NotFound).
#[test]
fn ended_reservations_are_forgotten_after_retention() {
    let settings = Settings {
        ended_retention_ms: 5_000,
        ..Settings::default()
    };
    check(
        setup_with(settings).kind("tenant", vec![sliding("tokens", 100, 60_000, 60)]),
        vec![
            at(3_000),
            reserve("s", "t", &[], &[("tokens", 1)]),
            settle("s", &[("tokens", 1)]),
            reserve("f", "t", &[], &[("tokens", 1)]),
            refund("f"),
            reservation_count(2),
            at(7_999),
            get("s").status(Status::Settled),
            get("f").status(Status::Refunded),
            at(8_000),
            get("s").gone(),
            get("f").gone(),
            reservation_count(0),
            settle("s", &[]).not_found(),
            refund("f").not_found(),
        ],
    );
}

// ============================================================================
// expiry and memory
// ============================================================================

/// Expiry is observed by every read (`get` answers Expired without
/// `expire_due`, a status shows the hold gone); `expire_due` processes what
/// is due; once everything ended and the windows emptied, `scope_count`
/// drops to 0 after `expire_due` (a scope first seen idle is looked at 5 s
/// later, `IDLE_SCOPE_GRACE_MS`), and `reservation_count` after retention.
#[test]
fn expiry_is_observed_lazily_and_memory_is_bounded() {
    let settings = Settings {
        ended_retention_ms: 5_000,
        ..Settings::default()
    };
    check(
        setup_with(settings)
            .kind("tenant", vec![sliding("tokens", 100, 10_000, 10)])
            .kind("agent", vec![bucket("tokens", 50, 10_000)]),
        vec![
            at(1_000),
            reserve("r1", "t", &[("agent", "a")], &[("tokens", 10)]).ttl(2_000),
            counts(2, 1, 1),
            at(2_999),
            get("r1").status(Status::Held),
            at(3_000),
            get("r1").status(Status::Expired),
            // Nothing was used, but both scopes were first seen idle at
            // 1 000 (nothing held yet): they are looked at from 6 000.
            counts(2, 1, 0),
            reserve("r2", "t", &[], &[("tokens", 10)]).ttl(1_000),
            at(4_000),
            expect(T, "tokens").holding(0),
            get("r2").status(Status::Expired),
            // A refund of an expired reservation is a no-op success.
            refund("r2").status(Status::Expired),
            expire_due(2),
            // Usage: the tenant's slice [4 000, 5 000) leaves at 14 000; the
            // agent's bucket is full again 20 × 200 ms later, at 8 000.
            reserve("r3", "t", &[("agent", "a")], &[("tokens", 20)]),
            settle("r3", &[("tokens", 20)]),
            // A status of a scope never used creates nothing.
            expect("tenant:zzz", "tokens").remaining(100),
            scope_count(2),
            at(8_999),
            expire_due(2),
            counts(1, 2, 0),
            at(9_000),
            expire_due(2),
            reservation_count(0),
            at(13_999),
            expire_due(2),
            scope_count(1),
            at(14_000),
            expire_due(2),
            counts(0, 0, 0),
        ],
    );
}

/// An idle scope is kept for the grace (5 s from when it was first seen
/// holding nothing) and then dropped if its windows are empty, even if it
/// was used in between: a scope used on and off is dropped and built again
/// at most once per grace, not after every reservation that ends.
#[test]
fn idle_scopes_are_dropped_after_a_grace() {
    check(
        setup().kind("tenant", vec![concurrent(2)]),
        vec![
            at(1_000),
            reserve("r1", "t", &[], &[]),
            settle("r1", &[]),
            expire_due(0),
            scope_count(1),
            at(5_999),
            reserve("r2", "t", &[], &[]),
            refund("r2"),
            expire_due(0),
            scope_count(1),
            at(6_000),
            expire_due(0),
            scope_count(0),
            // Built again on its next use.
            reserve("r3", "t", &[], &[]),
            expect(T, "concurrent").holding(1),
            scope_count(1),
            refund("r3"),
            at(10_999),
            expire_due(0),
            scope_count(1),
            at(11_000),
            expire_due(0),
            scope_count(0),
        ],
    );
}

/// A reservation is expired iff `now ≥ expires_at`: a settle at exactly
/// `expires_at` is late (the hold was released once, by the expiry), one a
/// millisecond before is not.
#[test]
fn expiry_is_inclusive_of_expires_at() {
    check(
        setup().kind("tenant", vec![sliding("tokens", 100, 60_000, 60)]),
        vec![
            at(1_000),
            reserve("a", "t", &[], &[("tokens", 10)]).ttl(500),
            reserve("b", "t", &[], &[("tokens", 10)]).ttl(500),
            at(1_499),
            settle("a", &[("tokens", 10)]).late(false),
            at(1_500),
            settle("b", &[("tokens", 10)]).late(true),
            expect(T, "tokens").used(20).holding(0).remaining(80),
        ],
    );
}
