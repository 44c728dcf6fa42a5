//! What every multi-process scenario produces, and how the workers check
//! that what they were handed is what was produced.
//!
//! By default a task's `parameters_bytes` are 64 bytes of 0x80, as they
//! always were. With `--payload-bytes N` they are N bytes of SplitMix64
//! seeded by an FNV-1a hash of the task's id: incompressible, so neither
//! PostgreSQL's TOAST compression nor anything else makes a large task
//! cheaper than it is; about as fast to make as to copy; and reproducible
//! from the id alone, so the workers check every byte without being told
//! anything but N.
//!
//! Apart from its id, `received_at` and parameters, every task is the
//! same, so a worker rebuilds the whole activation it should have got from
//! the one it got and compares all of it: a broker that changed any field
//! on the way is caught, not only one that damaged the parameters.

use std::time::SystemTime;

use taskbroker::proto::{RetryState, TaskActivation};

/// A task's `parameters_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parameters {
    /// 64 bytes of 0x80 (no `--payload-bytes`).
    Small,
    /// This many pseudo-random bytes, derived from the task's id.
    Random(usize),
}

impl Parameters {
    pub fn from_flag(payload_bytes: Option<usize>) -> Parameters {
        payload_bytes.map_or(Parameters::Small, Parameters::Random)
    }

    /// The `--payload-bytes` that gives these parameters.
    pub fn as_flag(self) -> Option<usize> {
        match self {
            Parameters::Small => None,
            Parameters::Random(bytes) => Some(bytes),
        }
    }

    pub fn len(self) -> usize {
        match self {
            Parameters::Small => SMALL.len(),
            Parameters::Random(bytes) => bytes,
        }
    }

    /// The parameters of the task `id`.
    pub fn for_id(self, id: &str) -> Vec<u8> {
        match self {
            Parameters::Small => SMALL.to_vec(),
            Parameters::Random(len) => {
                let mut stream = SplitMix64::for_id(id);
                let mut bytes = vec![0; len];
                for chunk in bytes.chunks_mut(8) {
                    chunk.copy_from_slice(&stream.next_word()[..chunk.len()]);
                }
                bytes
            }
        }
    }

    /// Whether `bytes` are the parameters of the task `id`, every byte
    /// compared against the stream as it is generated (no copy is made).
    fn are_those_of(self, id: &str, bytes: &[u8]) -> bool {
        match self {
            Parameters::Small => bytes == SMALL,
            Parameters::Random(len) => {
                let mut stream = SplitMix64::for_id(id);
                bytes.len() == len
                    && bytes
                        .chunks(8)
                        .all(|chunk| chunk == &stream.next_word()[..chunk.len()])
            }
        }
    }
}

const SMALL: [u8; 64] = [0x80; 64];

/// A new task (fresh id, `received_at` now) as every scenario produces it:
/// a no-op task of the `bench` application, one attempt, 60 s processing
/// deadline.
pub fn activation(parameters: Parameters) -> TaskActivation {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mut task = without_parameters(id, Some(SystemTime::now().into()));
    task.parameters_bytes = parameters.for_id(&task.id);
    task
}

/// The largest a produced task is, encoded: what a Kafka record carries
/// (`received_at`'s nanoseconds take one to five bytes).
pub fn encoded_len(parameters: Parameters) -> usize {
    let mut received_at = prost_types::Timestamp::from(SystemTime::now());
    received_at.nanos = 999_999_999;
    let mut task = without_parameters(uuid::Uuid::nil().simple().to_string(), Some(received_at));
    task.parameters_bytes = vec![0; parameters.len()];
    prost::Message::encoded_len(&task)
}

fn without_parameters(id: String, received_at: Option<prost_types::Timestamp>) -> TaskActivation {
    TaskActivation {
        id,
        namespace: "bench".to_owned(),
        taskname: "bench.noop".to_owned(),
        received_at,
        retry_state: Some(RetryState {
            max_attempts: 1,
            ..Default::default()
        }),
        processing_deadline_duration: 60,
        application: Some("bench".to_owned()),
        ..Default::default()
    }
}

/// Whether `task` is, field by field and byte by byte, the one produced
/// with its id and `received_at`. The parameters are moved out for the
/// comparison and back, so a large task is never copied.
pub fn is_as_produced(task: &mut TaskActivation, parameters: Parameters) -> bool {
    let delivered = std::mem::take(&mut task.parameters_bytes);
    let same = *task == without_parameters(task.id.clone(), task.received_at)
        && parameters.are_those_of(&task.id, &delivered);
    task.parameters_bytes = delivered;
    same
}

/// SplitMix64 (Steele, Lea and Flood, 2014): one addition and two
/// multiplications per eight bytes, and it passes BigCrush.
struct SplitMix64(u64);

impl SplitMix64 {
    /// Seeded by the FNV-1a hash of `id`, the same in every process and
    /// build (std's hashers promise neither).
    fn for_id(id: &str) -> SplitMix64 {
        let seed = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        SplitMix64(seed)
    }

    fn next_word(&mut self) -> [u8; 8] {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)).to_le_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_parameters_are_the_small_activation_of_before() {
        let task = activation(Parameters::Small);
        assert_eq!(task.parameters_bytes, vec![0x80; 64]);
        assert_eq!(Parameters::from_flag(None), Parameters::Small);
    }

    #[test]
    fn random_parameters_are_reproducible_from_the_id_and_differ_between_ids() {
        let parameters = Parameters::Random(1001);
        let a = parameters.for_id("a");
        assert_eq!(a.len(), 1001);
        assert_eq!(a, parameters.for_id("a"));
        assert_ne!(a, parameters.for_id("b"));
        // Not a short repeating pattern: every byte value turns up.
        let mut seen = [false; 256];
        for byte in Parameters::Random(64 << 10).for_id("a") {
            seen[usize::from(byte)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn a_delivered_task_is_as_produced_only_if_every_byte_and_field_is() {
        for parameters in [Parameters::Small, Parameters::Random(4099)] {
            let produced = activation(parameters);
            let mut delivered = produced.clone();
            assert!(is_as_produced(&mut delivered, parameters));
            // Moved out and back: the task is untouched.
            assert_eq!(delivered, produced);

            let last = delivered.parameters_bytes.len() - 1;
            delivered.parameters_bytes[last] ^= 1;
            assert!(!is_as_produced(&mut delivered, parameters));

            let mut truncated = produced.clone();
            truncated.parameters_bytes.pop();
            assert!(!is_as_produced(&mut truncated, parameters));

            let mut renamed = produced.clone();
            renamed.taskname = "bench.other".to_owned();
            assert!(!is_as_produced(&mut renamed, parameters));
        }
        // Parameters of another size than the workers were told.
        let mut task = activation(Parameters::Random(100));
        assert!(!is_as_produced(&mut task, Parameters::Random(101)));
    }

    #[test]
    fn encoded_len_bounds_a_produced_record_within_its_timestamp() {
        for parameters in [Parameters::Small, Parameters::Random(1 << 20)] {
            let record = prost::Message::encode_to_vec(&activation(parameters));
            assert!(record.len() <= encoded_len(parameters));
            assert!(record.len() + 4 >= encoded_len(parameters));
        }
    }
}
