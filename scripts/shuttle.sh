#!/usr/bin/env bash
# Model-checks SharedLedger's locking protocol with shuttle: builds
# allowance-core with shuttle's mutexes (--cfg allowance_shuttle) in a target
# dir of its own, so the normal build's artifacts are not invalidated, and
# runs tests/shuttle.rs in release (shuttle explores thousands of schedules).
# Extra arguments go to `cargo test` (e.g. a test name, or `-- --nocapture`);
# ALLOWANCE_SHUTTLE_ITERS sets the schedules per scheduler and scenario.
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="--cfg allowance_shuttle" CARGO_TARGET_DIR=target/shuttle \
    cargo test -p allowance-core --test shuttle --release "$@"
