//! The web UI: a single page (HTML, JavaScript, CSS) compiled into the binary, served by the
//! management listener at `/`. It calls the same `/api` endpoints as any other client, with the
//! credentials the user logs in with, so it can do nothing the API would not let that user do.
//!
//! No build step: the assets are plain files under `management/ui/`, embedded with
//! `include_bytes!`. For UI development, `WARREN_UI_DIR` names a directory whose files are served
//! instead (read per request, so an edit shows on reload without rebuilding the broker).

use axum::Router;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// One embedded asset: the name it is served under, its content type and its bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    bytes: &'static [u8],
}

/// Every file of the UI. `index.html` is also served at `/`.
const ASSETS: &[Asset] = &[
    Asset {
        name: "index.html",
        content_type: "text/html; charset=utf-8",
        bytes: include_bytes!("../ui/index.html"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../ui/app.js"),
    },
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("../ui/app.css"),
    },
];

/// The UI routes: `/` and `/ui/{file}`.
pub fn router() -> Router {
    Router::new()
        .route("/", get(|| async { asset("index.html") }))
        .route(
            "/ui/{file}",
            get(|Path(file): Path<String>| async move { asset(&file) }),
        )
}

fn asset(name: &str) -> Response {
    let Some(a) = ASSETS.iter().find(|a| a.name == name) else {
        return (StatusCode::NOT_FOUND, "Not Found").into_response();
    };
    let body = match std::env::var_os("WARREN_UI_DIR") {
        // `name` is one of the fixed names above, never a path from the request.
        Some(dir) => match std::fs::read(std::path::Path::new(&dir).join(a.name)) {
            Ok(b) => b,
            Err(_) => a.bytes.to_vec(),
        },
        None => a.bytes.to_vec(),
    };
    (
        [
            (header::CONTENT_TYPE, a.content_type),
            // The page is small and must follow the binary's version, not a stale cache.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_asset_is_nonempty_and_unknown_names_are_404() {
        for a in ASSETS {
            assert!(!a.bytes.is_empty(), "{} is empty", a.name);
            assert_eq!(asset(a.name).status(), StatusCode::OK);
        }
        assert_eq!(asset("../Cargo.toml").status(), StatusCode::NOT_FOUND);
        assert_eq!(asset("nope.js").status(), StatusCode::NOT_FOUND);
    }
}
