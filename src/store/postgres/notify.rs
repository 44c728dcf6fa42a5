//! Wake-ups across replicas: every insert that stored rows announces them
//! with `pg_notify` (see `sql::INSERT`), and each broker keeps one extra
//! connection that `LISTEN`s, so an idle fetcher of any replica claims a
//! new row at once instead of at its next poll.
//!
//! The listening connection is not pooled. When it fails it is opened
//! again with backoff; every (re)connect yields one wake-up, since rows may
//! have arrived while nobody listened. Wake-ups are coalesced: a consumer
//! that is slow to take them sees one, not a queue. Announcements of this
//! store's own inserts are skipped: the consumer that stored them wakes
//! this broker's fetchers in-process, and a second wake-up would only cost
//! each fetcher an empty claim.

use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;

use super::pool::describe;
use super::sql::NEW_ROWS_CHANNEL;
use super::tls::RustlsConnect;

const FIRST_RETRY: Duration = Duration::from_millis(500);
const LAST_RETRY: Duration = Duration::from_secs(30);

/// Starts listening (on the current tokio runtime) and answers the stream
/// of wake-ups; the listener stops when the stream is dropped.
pub(super) fn listen(
    config: tokio_postgres::Config,
    connector: RustlsConnect,
    own: String,
) -> BoxStream<'static, ()> {
    let (wake, woken) = mpsc::channel::<()>(1);
    tokio::spawn(async move {
        let mut retry = FIRST_RETRY;
        loop {
            let outcome = tokio::select! {
                outcome = listen_once(&config, connector.clone(), &own, &wake, &mut retry) => outcome,
                () = wake.closed() => return,
            };
            match outcome {
                Ok(()) => return,
                Err(err) => {
                    crate::warn_throttled!(error = %err, retry_in = ?retry,
                        "listening for new rows failed; fetchers poll meanwhile");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(retry) => {}
                () = wake.closed() => return,
            }
            retry = (retry * 2).min(LAST_RETRY);
        }
    });
    futures::stream::unfold(woken, |mut woken| async move {
        woken.recv().await.map(|()| ((), woken))
    })
    .boxed()
}

/// One listening connection, until it fails (`Err`) or nobody takes
/// wake-ups any more (`Ok`).
async fn listen_once(
    config: &tokio_postgres::Config,
    connector: RustlsConnect,
    own: &str,
    wake: &mpsc::Sender<()>,
    retry: &mut Duration,
) -> Result<(), String> {
    let (client, mut connection) = config.connect(connector).await.map_err(|e| describe(&e))?;
    let (notified, mut notifications) = mpsc::unbounded_channel::<()>();
    let own = own.to_owned();
    let driver = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(note)) if note.payload() == own => {}
                Ok(AsyncMessage::Notification(_)) => {
                    if notified.send(()).is_err() {
                        return Ok(());
                    }
                }
                Ok(_) => {}
                Err(err) => return Err(describe(&err)),
            }
        }
        Err("the database closed the connection".to_owned())
    });
    let listening = client
        .batch_execute(&format!("LISTEN {NEW_ROWS_CHANNEL}"))
        .await
        .map_err(|e| describe(&e));
    if let Err(err) = listening {
        driver.abort();
        return Err(err);
    }
    *retry = FIRST_RETRY;
    // Rows stored while nobody listened.
    let _ = wake.try_send(());
    while notifications.recv().await.is_some() {
        // Full: a wake-up is already waiting, which covers this one.
        if let Err(mpsc::error::TrySendError::Closed(())) = wake.try_send(()) {
            driver.abort();
            return Ok(());
        }
    }
    drop(client);
    match driver.await {
        Ok(result) => result,
        Err(err) => Err(format!("listener task: {err}")),
    }
}
