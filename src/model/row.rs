//! An in-flight activation as the store keeps it: its row, its lifecycle
//! status, the fence a claim holds on it, and the bucket that decides which
//! FetchActor claims it.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};

use super::claim::ClaimToken;
use super::retry::RetryEdit;

/// Where an activation is in its lifecycle (DESIGN.md, "Activation lifecycle").
/// Stored as its name in the `status` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ActivationStatus {
    Pending,
    Delay,
    Claimed,
    Processing,
    Retry,
    Failure,
    Complete,
}

impl ActivationStatus {
    pub const ALL: [ActivationStatus; 7] = [
        ActivationStatus::Pending,
        ActivationStatus::Delay,
        ActivationStatus::Claimed,
        ActivationStatus::Processing,
        ActivationStatus::Retry,
        ActivationStatus::Failure,
        ActivationStatus::Complete,
    ];

    /// The status as a metric label value: lowercase, as Prometheus
    /// convention has it.
    pub fn metric_label(self) -> &'static str {
        match self {
            ActivationStatus::Pending => "pending",
            ActivationStatus::Delay => "delay",
            ActivationStatus::Claimed => "claimed",
            ActivationStatus::Processing => "processing",
            ActivationStatus::Retry => "retry",
            ActivationStatus::Failure => "failure",
            ActivationStatus::Complete => "complete",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ActivationStatus::Pending => "Pending",
            ActivationStatus::Delay => "Delay",
            ActivationStatus::Claimed => "Claimed",
            ActivationStatus::Processing => "Processing",
            ActivationStatus::Retry => "Retry",
            ActivationStatus::Failure => "Failure",
            ActivationStatus::Complete => "Complete",
        }
    }
}

impl fmt::Display for ActivationStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ActivationStatus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ActivationStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| s.to_owned())
    }
}

/// What to do with a task whose attempts ran out. Stored as the wire enum's
/// number; `Unspecified` behaves as `Discard` (PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnAttemptsExceeded {
    Unspecified,
    Discard,
    Deadletter,
}

impl OnAttemptsExceeded {
    pub fn as_i32(self) -> i32 {
        match self {
            OnAttemptsExceeded::Unspecified => 0,
            OnAttemptsExceeded::Discard => 1,
            OnAttemptsExceeded::Deadletter => 2,
        }
    }

    pub fn from_i32(value: i32) -> Option<Self> {
        match value {
            0 => Some(OnAttemptsExceeded::Unspecified),
            1 => Some(OnAttemptsExceeded::Discard),
            2 => Some(OnAttemptsExceeded::Deadletter),
            _ => None,
        }
    }
}

/// One row of `inflight_taskactivations`.
#[derive(Debug, Clone, PartialEq)]
pub struct InflightActivation {
    pub id: String,
    /// The serialized `TaskActivation`, exactly as received: never rewritten.
    pub activation: Vec<u8>,
    pub topic: String,
    pub partition: i32,
    pub kafka_offset: i64,
    pub added_at: DateTime<Utc>,
    pub received_at: DateTime<Utc>,
    pub processing_attempts: i32,
    pub expires_at: Option<DateTime<Utc>>,
    pub delay_until: Option<DateTime<Utc>>,
    pub processing_deadline_duration: i32,
    pub processing_deadline: Option<DateTime<Utc>>,
    pub claim_expires_at: Option<DateTime<Utc>>,
    pub status: ActivationStatus,
    pub at_most_once: bool,
    pub application: String,
    pub namespace: String,
    pub taskname: String,
    pub on_attempts_exceeded: OnAttemptsExceeded,
    pub bucket: i16,
    /// The worker's edit to the retry state, from a RETRY report
    /// (`retry_max_attempts`, `retry_delay_on_retry`); applied to the retry
    /// upkeep publishes, not to `activation`.
    pub retry_edit: RetryEdit,
}

impl InflightActivation {
    /// The fence for this row's current claim, if it is claimed.
    pub fn claim_token(&self) -> Option<ClaimToken> {
        self.claim_expires_at.map(|claim_expires_at| ClaimToken {
            id: self.id.clone(),
            claim_expires_at,
        })
    }
}

/// So code over rows takes claimed rows (`ClaimedActivation`) as well.
impl AsRef<InflightActivation> for InflightActivation {
    fn as_ref(&self) -> &InflightActivation {
        self
    }
}

/// Number of buckets activations are spread over (`bucket` is 0..=255).
pub const BUCKET_COUNT: u16 = 256;

/// An inclusive range of buckets, owned by one FetchActor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketRange {
    pub first: i16,
    pub last: i16,
}

impl BucketRange {
    pub const ALL: BucketRange = BucketRange {
        first: 0,
        last: (BUCKET_COUNT - 1) as i16,
    };

    /// Range `index` of `count` equal slices of 0..=255. `count` must be a
    /// power of two between 1 and 256 (validated by configuration).
    pub fn slice(index: u16, count: u16) -> BucketRange {
        let count = count.clamp(1, BUCKET_COUNT);
        let width = BUCKET_COUNT / count;
        let index = index.min(count - 1);
        BucketRange {
            first: (index * width) as i16,
            last: (index * width + width - 1) as i16,
        }
    }
}

/// Stable bucket 0..=255 for an activation id: FNV-1a over the id's bytes,
/// folded to one byte. Works for any id, UUID or not, and never changes
/// between releases (buckets are persisted).
pub fn bucket_for_id(id: &str) -> i16 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in id.as_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    let folded = (hash ^ (hash >> 8) ^ (hash >> 16) ^ (hash >> 24)) & 0xff;
    folded as i16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_is_stable_and_in_range() {
        assert_eq!(bucket_for_id("abc"), bucket_for_id("abc"));
        for i in 0..10_000 {
            let bucket = bucket_for_id(&format!("id-{i}"));
            assert!((0..=255).contains(&bucket));
        }
        assert!((0..=255).contains(&bucket_for_id("")));
    }

    #[test]
    fn buckets_spread_uuids_evenly() {
        let mut counts = [0u32; 256];
        for _ in 0..256 * 200 {
            let id = uuid::Uuid::new_v4().simple().to_string();
            counts[bucket_for_id(&id) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(
            *min > 100 && *max < 320,
            "uneven buckets: min {min} max {max}"
        );
    }

    #[test]
    fn bucket_slices_cover_all_buckets_once() {
        for count in [1u16, 2, 4, 8, 16, 32, 64, 128, 256] {
            let mut next = 0;
            for index in 0..count {
                let range = BucketRange::slice(index, count);
                assert_eq!(range.first, next);
                next = range.last + 1;
            }
            assert_eq!(next, 256);
        }
    }

    #[test]
    fn status_names_round_trip() {
        for status in ActivationStatus::ALL {
            assert_eq!(status.as_str().parse::<ActivationStatus>(), Ok(status));
        }
        assert!("Bogus".parse::<ActivationStatus>().is_err());
    }
}
