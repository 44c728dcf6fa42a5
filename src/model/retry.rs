//! What a retry makes of a stored activation: the edit a worker's RETRY
//! report may carry, and the new activation upkeep publishes to the retry
//! topic. The store keeps the edit beside the row (two plain columns) and
//! never rewrites the stored bytes; the edit is applied here, once, to the
//! bytes that leave for Kafka.

use chrono::{DateTime, Utc};
use prost::Message;

use super::activation::ActivationError;
use super::row::InflightActivation;
use crate::proto::{RetryState, TaskActivation};

/// A worker's edits to a task's `retry_state`, sent with a RETRY report:
/// each given value replaces the stored activation's in the retry upkeep
/// publishes. Rows that were never retried with edits carry none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryEdit {
    /// Replaces `retry_state.max_attempts`.
    pub max_attempts: Option<u32>,
    /// Replaces `retry_state.delay_on_retry`.
    pub delay_on_retry: Option<u64>,
}

impl RetryEdit {
    /// Whether this edit changes nothing.
    pub fn is_empty(&self) -> bool {
        self.max_attempts.is_none() && self.delay_on_retry.is_none()
    }

    /// Writes the given values into `retry_state`, keeping the others.
    fn apply(&self, retry_state: &mut RetryState) {
        if let Some(max_attempts) = self.max_attempts {
            retry_state.max_attempts = max_attempts;
        }
        if let Some(delay) = self.delay_on_retry {
            retry_state.delay_on_retry = Some(delay);
        }
    }
}

/// Namespace of the UUIDv5 ids [`retry_activation`] derives. Fixed forever:
/// changing it would give a replayed retry a different id than the one
/// already published.
pub const RETRY_ID_NAMESPACE: uuid::Uuid = uuid::uuid!("5609e723-3c48-41d9-af1c-cda0c14cf711");

/// The activation upkeep produces to the retry topic for a task a worker
/// asked to retry (PROTOCOL.md, "Kafka payloads"): the worker's `edit`
/// applied to the stored retry state, then a new id, `received_at` now, one
/// more attempt, `delay` taken from `delay_on_retry` (cleared when that is
/// unset); everything else kept. Answers the new id and the bytes.
///
/// The new id is UUIDv5 of `"<original id>/<attempt>"` (the attempt number
/// after the increment), not a random one: when a broker dies after Kafka
/// acknowledged the retry but before the row was marked published, the row
/// is published again with the same id, and ingest's `ON CONFLICT (id)`
/// stores it once.
pub fn retry_activation(
    stored: &[u8],
    edit: &RetryEdit,
    now: DateTime<Utc>,
) -> Result<(String, Vec<u8>), ActivationError> {
    let mut activation = TaskActivation::decode(stored)
        .map_err(|err| ActivationError::Undecodable(err.to_string()))?;
    let retry_state = activation.retry_state.get_or_insert_with(Default::default);
    edit.apply(retry_state);
    retry_state.attempts = retry_state.attempts.saturating_add(1);
    activation.delay = retry_state.delay_on_retry.filter(|delay| *delay > 0);
    let lineage = format!("{}/{}", activation.id, retry_state.attempts);
    activation.id = uuid::Uuid::new_v5(&RETRY_ID_NAMESPACE, lineage.as_bytes()).to_string();
    activation.received_at = Some(prost_types::Timestamp {
        seconds: now.timestamp(),
        nanos: i32::try_from(now.timestamp_subsec_nanos()).unwrap_or(0),
    });
    Ok((activation.id.clone(), activation.encode_to_vec()))
}

impl InflightActivation {
    /// This Retry row's activation for the retry topic: its stored bytes
    /// with its `retry_edit` applied (see [`retry_activation`]).
    pub fn retry_activation(
        &self,
        now: DateTime<Utc>,
    ) -> Result<(String, Vec<u8>), ActivationError> {
        retry_activation(&self.activation, &self.retry_edit, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::activation::tests::{base_activation, now};
    use chrono::TimeDelta;

    const NO_EDIT: RetryEdit = RetryEdit {
        max_attempts: None,
        delay_on_retry: None,
    };

    #[test]
    fn retry_activation_is_a_fresh_next_attempt() {
        let mut activation = base_activation();
        activation.delay = Some(99);
        activation.headers.insert("k".into(), "v".into());
        activation.retry_state = Some(RetryState {
            attempts: 1,
            max_attempts: 5,
            delay_on_retry: Some(30),
            ..Default::default()
        });
        let (id, bytes) = retry_activation(&activation.encode_to_vec(), &NO_EDIT, now()).unwrap();
        let retried = TaskActivation::decode(bytes.as_slice()).unwrap();
        assert_eq!(retried.id, id);
        assert_ne!(retried.id, activation.id);
        assert_eq!(retried.received_at.unwrap().seconds, now().timestamp());
        assert_eq!(retried.retry_state.unwrap().attempts, 2);
        assert_eq!(retried.delay, Some(30));
        assert_eq!(retried.headers, activation.headers);
        assert_eq!(retried.taskname, activation.taskname);

        activation.retry_state.as_mut().unwrap().delay_on_retry = None;
        let (_, bytes) = retry_activation(&activation.encode_to_vec(), &NO_EDIT, now()).unwrap();
        assert_eq!(
            TaskActivation::decode(bytes.as_slice()).unwrap().delay,
            None
        );
        assert!(retry_activation(&[0xff, 0xff], &NO_EDIT, now()).is_err());
    }

    #[test]
    fn retry_ids_follow_from_the_original_id_and_attempt() {
        let mut activation = base_activation();
        activation.retry_state = Some(RetryState {
            attempts: 2,
            ..Default::default()
        });
        let bytes = activation.encode_to_vec();
        let later = now() + TimeDelta::seconds(5);
        let (first, _) = retry_activation(&bytes, &NO_EDIT, now()).unwrap();
        let (replayed, _) = retry_activation(&bytes, &NO_EDIT, later).unwrap();
        assert_eq!(first, replayed, "a republished retry keeps its id");
        let expected = uuid::Uuid::new_v5(
            &RETRY_ID_NAMESPACE,
            format!("{}/3", activation.id).as_bytes(),
        );
        assert_eq!(first, expected.to_string());

        activation.retry_state.as_mut().unwrap().attempts = 3;
        let (next_attempt, _) =
            retry_activation(&activation.encode_to_vec(), &NO_EDIT, now()).unwrap();
        assert_ne!(next_attempt, first, "each attempt has its own id");
        activation.id = "another".into();
        activation.retry_state.as_mut().unwrap().attempts = 2;
        let (other_task, _) =
            retry_activation(&activation.encode_to_vec(), &NO_EDIT, now()).unwrap();
        assert_ne!(other_task, first, "each task has its own ids");
    }

    #[test]
    fn the_edit_replaces_what_it_names_and_keeps_the_rest() {
        let mut activation = base_activation();
        activation.retry_state = Some(RetryState {
            attempts: 2,
            max_attempts: 3,
            delay_on_retry: Some(4),
            ..Default::default()
        });
        let stored = activation.encode_to_vec();
        let retried = |edit: RetryEdit| {
            let (_, bytes) = retry_activation(&stored, &edit, now()).unwrap();
            TaskActivation::decode(bytes.as_slice()).unwrap()
        };

        let both = retried(RetryEdit {
            max_attempts: Some(9),
            delay_on_retry: Some(15),
        });
        let state = both.retry_state.unwrap();
        assert_eq!(
            (state.attempts, state.max_attempts, state.delay_on_retry),
            (3, 9, Some(15))
        );
        assert_eq!(both.delay, Some(15), "the edited delay is the retry's");
        assert_eq!(both.taskname, activation.taskname);

        let only_attempts = retried(RetryEdit {
            max_attempts: Some(7),
            delay_on_retry: None,
        });
        let state = only_attempts.retry_state.unwrap();
        assert_eq!((state.max_attempts, state.delay_on_retry), (7, Some(4)));
        assert_eq!(only_attempts.delay, Some(4));

        // The id follows from the original id and attempt, edit or not.
        assert_eq!(
            retried(NO_EDIT).id,
            retried(RetryEdit {
                max_attempts: Some(1),
                delay_on_retry: Some(1),
            })
            .id
        );
    }

    #[test]
    fn the_retry_is_byte_for_byte_what_rewriting_the_stored_bytes_gave() {
        // Before the edit left the store, a RETRY edit re-encoded the stored
        // activation with the new retry state, and the retry was made from
        // those bytes. Applying the edit on the way out must give the same.
        let mut activation = base_activation();
        activation.headers.insert("k".into(), "v".into());
        activation.retry_state = Some(RetryState {
            attempts: 1,
            max_attempts: 3,
            delay_on_retry: Some(4),
            at_most_once: Some(false),
            ..Default::default()
        });
        let stored = activation.encode_to_vec();
        for edit in [
            NO_EDIT,
            RetryEdit {
                max_attempts: Some(9),
                delay_on_retry: Some(0),
            },
            RetryEdit {
                max_attempts: None,
                delay_on_retry: Some(u64::MAX),
            },
        ] {
            // The removed rewrite, spelled out: named fields replaced, the
            // rest kept.
            let mut rewritten = TaskActivation::decode(stored.as_slice()).unwrap();
            let state = rewritten.retry_state.get_or_insert_with(Default::default);
            if let Some(max_attempts) = edit.max_attempts {
                state.max_attempts = max_attempts;
            }
            if let Some(delay) = edit.delay_on_retry {
                state.delay_on_retry = Some(delay);
            }
            let old = retry_activation(&rewritten.encode_to_vec(), &NO_EDIT, now()).unwrap();
            assert_eq!(retry_activation(&stored, &edit, now()).unwrap(), old);
        }
    }

    #[test]
    fn an_edit_gives_a_task_without_retry_state_one() {
        let (_, bytes) = retry_activation(
            &base_activation().encode_to_vec(),
            &RetryEdit {
                max_attempts: Some(4),
                delay_on_retry: None,
            },
            now(),
        )
        .unwrap();
        let state = TaskActivation::decode(bytes.as_slice())
            .unwrap()
            .retry_state
            .unwrap();
        assert_eq!((state.attempts, state.max_attempts), (1, 4));
        assert!(NO_EDIT.is_empty());
    }
}
