//! The dashboard at `/`: a page and its script and style, embedded in the binary (no build step,
//! nothing fetched from elsewhere). The page reads the JSON API every second, with the
//! credentials the browser gave for the page.

use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::Caller;

const PAGE: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/dashboard.js");
const STYLE: &str = include_str!("dashboard/dashboard.css");

/// Only this origin's script and style, no inline code, no framing by other sites.
const POLICY: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

// Each asset asks for a user when authentication is on, so the browser asks once, for the
// page, and sends the same credentials with the API requests.
pub(super) async fn page(_: Caller) -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

pub(super) async fn script(_: Caller) -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub(super) async fn style(_: Caller) -> Response {
    asset("text/css; charset=utf-8", STYLE)
}
