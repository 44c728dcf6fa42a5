//! A claim on a row: the fence every later transition names, and a claimed
//! activation, which always carries its fence (a claim without one cannot
//! be expressed).

use std::ops::Deref;

use chrono::{DateTime, Utc};

use super::row::InflightActivation;

/// A claim as its holder saw it: the row id and the `claim_expires_at` the
/// claim wrote. Transitions carrying a token only apply while the row is
/// still Claimed with exactly this expiry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimToken {
    pub id: String,
    pub claim_expires_at: DateTime<Utc>,
}

/// A row a claim returned: the activation as stored, Claimed, with the
/// token that fences every transition its holder makes.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedActivation {
    pub activation: InflightActivation,
    pub token: ClaimToken,
}

impl AsRef<InflightActivation> for ClaimedActivation {
    fn as_ref(&self) -> &InflightActivation {
        &self.activation
    }
}

/// A claimed activation reads as its row.
impl Deref for ClaimedActivation {
    type Target = InflightActivation;

    fn deref(&self) -> &InflightActivation {
        &self.activation
    }
}
