//! Operators' rules over tasks, set at runtime (the runtime file, see
//! `crate::runtime`): which tasks a killswitch drops, and which
//! applications and namespaces are paused. Plain values the store turns
//! into SQL and the consumer applies to records; how the file is read and
//! watched is not the domain's business.

use std::sync::Arc;

/// A name pattern: `*` matches any run of characters (none included), `?`
/// exactly one; every other character matches itself, case-sensitively.
/// Both stores match it the same way (PostgreSQL as `LIKE`, SQLite as
/// `GLOB`), and so does [`Glob::matches`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob(String);

impl Glob {
    pub fn new(pattern: impl Into<String>) -> Glob {
        Glob(pattern.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn matches(&self, text: &str) -> bool {
        let pattern: Vec<char> = self.0.chars().collect();
        let text: Vec<char> = text.chars().collect();
        // Iterative matching with one backtrack point (the last `*`): linear
        // in practice, and never recursive on hostile input.
        let (mut p, mut t) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while t < text.len() {
            match pattern.get(p) {
                Some('*') => {
                    star = Some((p, t));
                    p += 1;
                }
                Some('?') => {
                    p += 1;
                    t += 1;
                }
                Some(c) if *c == text[t] => {
                    p += 1;
                    t += 1;
                }
                _ => match star {
                    Some((star_p, star_t)) => {
                        p = star_p + 1;
                        t = star_t + 1;
                        star = Some((star_p, star_t + 1));
                    }
                    None => return false,
                },
            }
        }
        pattern[p..].iter().all(|c| *c == '*')
    }

    /// The pattern for PostgreSQL's `LIKE` (backslash escapes).
    pub fn to_like(&self) -> String {
        let mut like = String::with_capacity(self.0.len());
        for c in self.0.chars() {
            match c {
                '*' => like.push('%'),
                '?' => like.push('_'),
                '%' | '_' | '\\' => {
                    like.push('\\');
                    like.push(c);
                }
                _ => like.push(c),
            }
        }
        like
    }

    /// The pattern for SQLite's `GLOB`, whose `[` opens a character class.
    pub fn to_sqlite_glob(&self) -> String {
        self.0.replace('[', "[[]")
    }
}

/// Drop every task whose namespace and task name match (an absent pattern
/// matches anything; a killswitch always has at least one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Killswitch {
    pub namespace: Option<Glob>,
    pub taskname: Option<Glob>,
}

impl Killswitch {
    pub fn matches(&self, namespace: &str, taskname: &str) -> bool {
        self.namespace
            .as_ref()
            .is_none_or(|glob| glob.matches(namespace))
            && self
                .taskname
                .as_ref()
                .is_none_or(|glob| glob.matches(taskname))
    }

    /// Both patterns for SQL `LIKE`, an absent one as `%`.
    pub fn like_patterns(&self) -> (String, String) {
        let like =
            |glob: &Option<Glob>| glob.as_ref().map_or_else(|| "%".to_owned(), Glob::to_like);
        (like(&self.namespace), like(&self.taskname))
    }

    /// Both patterns for SQLite `GLOB`, an absent one as `*`.
    pub fn sqlite_patterns(&self) -> (String, String) {
        let glob = |glob: &Option<Glob>| {
            glob.as_ref()
                .map_or_else(|| "*".to_owned(), Glob::to_sqlite_glob)
        };
        (glob(&self.namespace), glob(&self.taskname))
    }
}

/// No claims (push or pull) for tasks of this application and namespace;
/// an absent name matches every application or namespace, so a rule with
/// neither pauses everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PauseRule {
    pub application: Option<String>,
    pub namespace: Option<String>,
}

impl PauseRule {
    pub fn matches(&self, application: &str, namespace: &str) -> bool {
        self.application
            .as_deref()
            .is_none_or(|paused| paused == application)
            && self
                .namespace
                .as_deref()
                .is_none_or(|paused| paused == namespace)
    }
}

/// The rules in force, shared by every part of the broker that applies
/// them; the empty default changes nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskRules {
    pub killswitches: Arc<[Killswitch]>,
    pub paused: Arc<[PauseRule]>,
    /// Namespaces whose tasks are forwarded, unchanged, to
    /// `demoted_topic` (at ingest, and by upkeep for stored rows) for a
    /// broker pool dedicated to slow work.
    pub demoted_namespaces: Arc<[String]>,
    pub demoted_topic: Arc<str>,
    /// Namespaces with at most this many tasks in flight (Claimed or
    /// Processing) across every broker sharing the store.
    pub concurrency_limits: Arc<[(String, u32)]>,
    /// Push dispatch weights per namespace (`weights`); a namespace not
    /// listed weighs 1.
    pub weights: Arc<[(String, u32)]>,
    /// What the ordinary claims leave out: the paused rules, every demoted
    /// namespace (its stored rows wait for upkeep to forward them) and
    /// every limited namespace (claimed by their own, counted claims).
    pub unclaimable: Arc<[PauseRule]>,
}

impl TaskRules {
    /// Whether a killswitch drops this task.
    pub fn killed(&self, namespace: &str, taskname: &str) -> bool {
        self.killswitches
            .iter()
            .any(|killswitch| killswitch.matches(namespace, taskname))
    }

    /// Whether claims skip this task.
    pub fn paused(&self, application: &str, namespace: &str) -> bool {
        self.paused
            .iter()
            .any(|rule| rule.matches(application, namespace))
    }

    /// The limited namespaces a claim may take from: those no pause rule
    /// could match (a limited claim takes every application's rows of its
    /// namespace, so a pause naming only an application holds limited
    /// namespaces entirely, erring on the side of the pause) and not
    /// demoted.
    pub fn limited_claims(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        self.concurrency_limits
            .iter()
            .filter(|(namespace, _)| {
                !self.paused.iter().any(|rule| {
                    rule.namespace
                        .as_deref()
                        .is_none_or(|paused| paused == namespace)
                }) && !self.demoted_namespaces.contains(namespace)
            })
            .map(|(namespace, limit)| (namespace.as_str(), *limit))
    }

    /// Whether a task of `namespace` consumed from `topic` is forwarded to
    /// the demoted topic: never when it came from that topic (the slow
    /// pool's own consumer stores what it reads).
    pub fn demoted(&self, namespace: &str, topic: &str) -> bool {
        topic != &*self.demoted_topic && self.demoted_namespaces.iter().any(|n| n == namespace)
    }
}

/// How a push claim chooses among the tasks waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch<'a> {
    /// Oldest `added_at` first, whatever its namespace.
    OldestFirst,
    /// Across namespaces: every flow (application and namespace) with
    /// Pending tasks gets a share of the batch in proportion to its weight
    /// (as listed, else 1), its own tasks oldest first, the flows
    /// interleaved by turn; what the shares leave unused is filled oldest
    /// first, so a batch is as full as before.
    Fair(&'a [(String, u32)]),
}

/// The weight of `namespace`: as listed, else 1.
pub fn weight_of(weights: &[(String, u32)], namespace: &str) -> u32 {
    weights
        .iter()
        .find(|(listed, _)| listed == namespace)
        .map_or(1, |(_, weight)| *weight)
}

/// Each flow's share of a batch of `limit`: ⌈limit × weight / total⌉, so
/// every flow with a weight gets at least one place.
pub fn fair_shares(limit: usize, weights: &[u32]) -> Vec<usize> {
    let total: u64 = weights.iter().map(|&weight| u64::from(weight)).sum();
    weights
        .iter()
        .map(|&weight| {
            let share = (limit as u64 * u64::from(weight)).div_ceil(total.max(1));
            usize::try_from(share).unwrap_or(limit).min(limit)
        })
        .collect()
}

/// A claim's byte budget over items in claim order: those whose
/// predecessors' sizes add up to less than `budget`, so always the first
/// and at most the budget plus one item.
pub fn within_bytes<T>(items: Vec<(T, usize)>, budget: usize) -> Vec<T> {
    let mut total = 0usize;
    items
        .into_iter()
        .take_while(|(_, size)| {
            let fits = total < budget;
            total = total.saturating_add(*size);
            fits
        })
        .map(|(item, _)| item)
        .collect()
}

/// Interleaves the flows' heads (each oldest first, at most its share) and
/// keeps the first `limit`: the k-th task of a flow of weight w takes its
/// turn at k / w, ties in the order of `tiebreak` (per flow; random in the
/// stores, so no flow always wins a tie).
pub fn interleave<T>(flows: Vec<(u32, Vec<T>)>, limit: usize, tiebreak: &[u64]) -> Vec<T> {
    let mut turns: Vec<(f64, u64, T)> = Vec::new();
    for (index, (weight, heads)) in flows.into_iter().enumerate() {
        let tie = tiebreak.get(index).copied().unwrap_or(index as u64);
        for (rank, item) in heads.into_iter().enumerate() {
            turns.push(((rank + 1) as f64 / f64::from(weight.max(1)), tie, item));
        }
    }
    turns.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    turns.truncate(limit);
    turns.into_iter().map(|(_, _, item)| item).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_claim_keeps_rows_until_their_bytes_reach_the_budget_and_always_one() {
        let sized = |sizes: &[usize]| -> Vec<(usize, usize)> {
            sizes.iter().copied().enumerate().collect()
        };
        assert_eq!(within_bytes(sized(&[4, 4, 4, 4, 4]), 16), [0, 1, 2, 3]);
        assert_eq!(within_bytes(sized(&[5, 5, 5, 5]), 16), [0, 1, 2, 3]);
        assert_eq!(within_bytes(sized(&[100, 1]), 16), [0]);
        assert_eq!(within_bytes(sized(&[1, 1, 1]), 16), [0, 1, 2]);
        assert!(within_bytes(sized(&[]), 16).is_empty());
    }

    use super::*;

    #[test]
    fn globs_match_stars_and_single_characters() {
        let cases = [
            ("*", "", true),
            ("*", "anything", true),
            ("a*", "a", true),
            ("a*c", "abbbc", true),
            ("a*c", "abbbd", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("*.send_*", "mail.send_welcome", true),
            ("*.send_*", "mail.receive", false),
            ("exact", "exact", true),
            ("exact", "Exact", false),
            ("*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaa", false),
            ("ünï*", "ünïcode", true),
        ];
        for (pattern, text, expected) in cases {
            assert_eq!(
                Glob::new(pattern).matches(text),
                expected,
                "{pattern:?} against {text:?}"
            );
        }
    }

    #[test]
    fn sql_patterns_escape_what_the_glob_takes_literally() {
        assert_eq!(Glob::new("a%b_c\\*?").to_like(), "a\\%b\\_c\\\\%_");
        assert_eq!(Glob::new("x[1]*").to_sqlite_glob(), "x[[]1]*");
        let killswitch = Killswitch {
            namespace: None,
            taskname: Some(Glob::new("t*")),
        };
        assert_eq!(
            killswitch.like_patterns(),
            ("%".to_owned(), "t%".to_owned())
        );
        assert_eq!(
            killswitch.sqlite_patterns(),
            ("*".to_owned(), "t*".to_owned())
        );
    }

    #[test]
    fn pause_rules_leave_out_what_they_do_not_name() {
        let app_only = PauseRule {
            application: Some("billing".to_owned()),
            namespace: None,
        };
        assert!(app_only.matches("billing", "any"));
        assert!(!app_only.matches("other", "any"));
        assert!(!app_only.matches("", "any"));
        let both = PauseRule {
            application: Some("billing".to_owned()),
            namespace: Some("invoices".to_owned()),
        };
        assert!(both.matches("billing", "invoices"));
        assert!(!both.matches("billing", "refunds"));
        let all = PauseRule {
            application: None,
            namespace: None,
        };
        assert!(all.matches("", "x"));
    }

    #[test]
    fn shares_follow_the_weights_and_give_every_flow_a_place() {
        assert_eq!(fair_shares(64, &[1]), [64]);
        assert_eq!(fair_shares(64, &[1, 1]), [32, 32]);
        assert_eq!(fair_shares(64, &[3, 1]), [48, 16]);
        assert_eq!(fair_shares(10, &[1, 1, 1]), [4, 4, 4]);
        // More flows than places: one each (the interleave keeps `limit`).
        assert_eq!(fair_shares(2, &[1, 1, 1, 1000]), [1, 1, 1, 2]);
        assert!(fair_shares(64, &[]).is_empty());
    }

    #[test]
    fn interleaving_takes_turns_by_weight() {
        let flows = vec![
            (1, vec!["b1", "b2", "b3", "b4"]),
            (1, vec!["s1", "s2"]),
            (2, vec!["h1", "h2", "h3", "h4"]),
        ];
        // Turns: h1 0.5; b1 s1 h2 1; h3 1.5; b2 s2 h4 2; b3 3 ...
        assert_eq!(
            interleave(flows.clone(), 6, &[2, 1, 0]),
            ["h1", "h2", "s1", "b1", "h3", "h4"]
        );
        assert_eq!(
            interleave(flows, 100, &[0, 1, 2]),
            ["h1", "b1", "s1", "h2", "h3", "b2", "s2", "h4", "b3", "b4"]
        );
        assert_eq!(weight_of(&[("a".to_owned(), 5)], "a"), 5);
        assert_eq!(weight_of(&[("a".to_owned(), 5)], "b"), 1);
    }
}
