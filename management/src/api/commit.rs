//! Waiting for commits: a store change is answered once durable ([`durably`], [`Commits`] for
//! a batch), a cluster change once the cluster committed it ([`committed`]). Imports no
//! sibling.

use std::sync::Arc;

use axum::http::StatusCode;

use super::{ApiResult, no_content};
use crate::ApiError;

pub(super) type CommitRx = tokio::sync::oneshot::Receiver<bool>;
type CommitTx = tokio::sync::oneshot::Sender<bool>;

fn commit_waiter() -> (CommitTx, CommitRx) {
    tokio::sync::oneshot::channel()
}

/// A store completion that reports to `tx` (the first completion asked for; later ones, if
/// any, report nothing).
fn waiter(tx: Option<CommitTx>) -> warren_store::writer::Completion {
    Box::new(move |r| {
        if let Some(tx) = tx {
            let _ = tx.send(r.is_ok());
        }
    })
}

/// Run `f` with a completion for the store and wait until what it changed is durable.
pub(super) async fn durably<T>(
    f: impl FnOnce(&mut dyn FnMut() -> warren_store::writer::Completion) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let mut commits = Commits::default();
    let out = {
        let mut done = commits.next();
        f(&mut done)?
    };
    commits.wait().await?;
    Ok(out)
}

/// Wait until the change is durable. A broker without a store never calls the completion:
/// the sender is dropped and the change counts as done.
async fn wait(rx: CommitRx) -> Result<(), ApiError> {
    match rx.await {
        Ok(false) => Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            error: "internal_error",
            reason: "the store did not commit the change".into(),
        }),
        _ => Ok(()),
    }
}

/// Commit waiters for a batch of changes: each change gets its completion, and the import
/// answers only once all are durable.
#[derive(Default)]
pub(super) struct Commits(Vec<CommitRx>);

impl Commits {
    pub(super) fn next(&mut self) -> impl FnMut() -> warren_store::writer::Completion + use<> {
        let (tx, rx) = commit_waiter();
        self.0.push(rx);
        let mut tx = Some(tx);
        move || waiter(tx.take())
    }

    pub(super) async fn wait(self) -> Result<(), ApiError> {
        for rx in self.0 {
            wait(rx).await?;
        }
        Ok(())
    }
}

/// The reply to a cluster change once `rx` says whether it committed.
pub(super) async fn committed(
    rx: tokio::sync::oneshot::Receiver<
        Result<Vec<warren_store::Location>, Arc<warren_store::StoreError>>,
    >,
) -> ApiResult {
    let unavailable = |reason: String| ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        error: "unavailable",
        reason,
    };
    match rx.await {
        Ok(Ok(_)) => no_content(),
        Ok(Err(e)) => Err(unavailable(e.to_string())),
        Err(_) => Err(unavailable("the cluster dropped the change".into())),
    }
}
