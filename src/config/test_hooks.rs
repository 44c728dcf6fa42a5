//! Test switches, compiled in only with the `test-hooks` cargo feature (off by default; the
//! test suite runs with `--all-features`). They are not settings: they are absent from
//! [`SETTINGS`](super::SETTINGS), from `docs/configuration.md` and from `taskbroker config`,
//! and a broker built without the feature reports them as unknown variables and ignores them.

/// `true` makes the broker leave claims that cannot be handed to a full push pool to their
/// lease instead of releasing them (the older design), so the stranded-claim benchmark
/// (`taskbroker-bench stranded --no-release-on-full`) can show both side by side.
pub const DISABLE_RELEASE_ON_FULL: &str = "TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL";

/// Every test switch, so `unknown_variables` does not report them in a `test-hooks` build.
pub const VARIABLES: &[&str] = &[DISABLE_RELEASE_ON_FULL];

/// Whether [`DISABLE_RELEASE_ON_FULL`] is `true` (ASCII case and surrounding whitespace
/// ignored) in the process environment; any other value leaves release-on-full on.
pub fn disable_release_on_full() -> bool {
    std::env::var(DISABLE_RELEASE_ON_FULL)
        .is_ok_and(|value| value.trim().eq_ignore_ascii_case("true"))
}
