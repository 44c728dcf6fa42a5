//! Fair dispatch on SQLite: the flows (application, namespace) with
//! Pending rows found by index seeks, each flow's share of a push claim
//! taken oldest first, interleaved by weighted turn and claimed in the
//! caller's write.

use std::hash::BuildHasher;

use rusqlite::{Connection, OptionalExtension, params};

use super::exec::{query_rows, sql_error};
use super::rows::{json_strings, limit};
use super::sql::{CLAIM_IDS, FIRST_FLOW, FLOW_HEADS, NEXT_APPLICATION, NEXT_NAMESPACE};
use crate::model::{
    BucketRange, InflightActivation, PauseRule, fair_shares, interleave, weight_of, within_bytes,
};
use crate::store::StoreResult;

/// Fair dispatch's share of a claim (see `ActivationStore::
/// claim_for_push_except`): every flow's oldest rows up to its share,
/// interleaved by weighted turn, cut to the byte budget in that order,
/// claimed. The caller fills the rest.
pub(super) fn claim_fair(
    connection: &Connection,
    buckets: BucketRange,
    (limit_rows, budget): (usize, usize),
    (expiry, claimer): (i64, &str),
    now: i64,
    weights: &[(String, u32)],
    paused: &[PauseRule],
) -> StoreResult<Vec<InflightActivation>> {
    const OP: &str = "claim_for_push";
    let failed = |e| sql_error(OP, e);
    let mut flows: Vec<(String, String)> = Vec::new();
    while let Some(flow) = next_flow(connection, flows.last()).map_err(failed)? {
        flows.push(flow);
    }
    flows.retain(|(application, namespace)| {
        !paused
            .iter()
            .any(|rule| rule.matches(application, namespace))
    });
    if flows.len() < 2 {
        // One flow: its share is the whole batch, which the caller's
        // oldest-first claim takes in one statement.
        return Ok(Vec::new());
    }
    let flow_weights: Vec<u32> = flows
        .iter()
        .map(|(_, namespace)| weight_of(weights, namespace))
        .collect();
    let shares = fair_shares(limit_rows, &flow_weights);
    let mut heads = Vec::with_capacity(flows.len());
    let mut statement = connection.prepare_cached(FLOW_HEADS).map_err(failed)?;
    for (((application, namespace), weight), share) in flows.iter().zip(&flow_weights).zip(shares) {
        let ids = statement
            .query_map(
                params![
                    application,
                    namespace,
                    buckets.first,
                    buckets.last,
                    now,
                    limit(share)
                ],
                |row| {
                    let size: i64 = row.get(1)?;
                    Ok((row.get::<_, String>(0)?, usize::try_from(size).unwrap_or(0)))
                },
            )
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .map_err(failed)?;
        heads.push((*weight, ids));
    }
    // Ties between flows go a different way on every claim.
    let random = std::collections::hash_map::RandomState::new();
    let tiebreak: Vec<u64> = (0..heads.len())
        .map(|index| random.hash_one(index))
        .collect();
    let chosen = within_bytes(interleave(heads, limit_rows, &tiebreak), budget);
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let ids = json_strings(chosen.iter().map(String::as_str));
    query_rows(connection, OP, CLAIM_IDS, params![ids, expiry, claimer])
}

/// The flow (application, namespace) with Pending rows after `previous`
/// in index order, or the first one: at most two index seeks.
fn next_flow(
    connection: &Connection,
    previous: Option<&(String, String)>,
) -> rusqlite::Result<Option<(String, String)>> {
    let flow = |row: &rusqlite::Row<'_>| Ok((row.get(0)?, row.get(1)?));
    let Some((application, namespace)) = previous else {
        return connection
            .prepare_cached(FIRST_FLOW)?
            .query_row([], flow)
            .optional();
    };
    if let Some(next) = connection
        .prepare_cached(NEXT_NAMESPACE)?
        .query_row(params![application, namespace], flow)
        .optional()?
    {
        return Ok(Some(next));
    }
    connection
        .prepare_cached(NEXT_APPLICATION)?
        .query_row(params![application], flow)
        .optional()
}
