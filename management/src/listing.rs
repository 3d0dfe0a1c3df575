//! RabbitMQ's list query parameters, applied to every list the API returns: `name` (with
//! `use_regex`) filters by name when a `page` is asked for, `sort` and `sort_reverse` order by any field (dotted for
//! nested ones), `columns` keeps only the given fields, and `page` / `page_size` return a page
//! in RabbitMQ's paginated shape. Applied as a layer on the JSON the handlers produce.

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::ApiError;

/// RabbitMQ's largest page.
pub const PAGE_SIZE_MAX: u64 = 500;
/// RabbitMQ's default page size.
pub const PAGE_SIZE_DEFAULT: u64 = 100;

/// The list parameters of a query string (others are ignored, as RabbitMQ does).
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    page: Option<String>,
    page_size: Option<String>,
    name: Option<String>,
    use_regex: Option<String>,
    sort: Option<String>,
    sort_reverse: Option<String>,
    columns: Option<String>,
}

impl ListQuery {
    fn any(&self) -> bool {
        self.page.is_some()
            || self.name.is_some()
            || self.sort.is_some()
            || self.sort_reverse.is_some()
            || self.columns.is_some()
    }
}

fn boolean(name: &str, v: Option<&str>) -> Result<bool, ApiError> {
    match v {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "{name} must be true or false, not {other:?}"
        ))),
    }
}

fn positive(name: &str, v: &str) -> Result<u64, ApiError> {
    v.parse::<u64>()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| ApiError::bad_request(format!("{name} must be a positive integer")))
}

fn field<'a>(item: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(item, |v, k| v.get(k))
}

fn compare(a: Option<&Value>, b: Option<&Value>) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x
            .as_f64()
            .partial_cmp(&y.as_f64())
            .unwrap_or(Ordering::Equal),
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (Some(x), Some(y)) => x.to_string().cmp(&y.to_string()),
        (None, None) => Ordering::Equal,
    }
}

/// Keep only `columns` (dotted paths) of `item`.
fn project(item: &Value, columns: &[&str]) -> Value {
    let mut out = Map::new();
    for c in columns {
        let Some(v) = field(item, c) else { continue };
        let mut parts = c.split('.').peekable();
        let mut at = &mut out;
        while let Some(k) = parts.next() {
            if parts.peek().is_none() {
                at.insert(k.to_string(), v.clone());
                break;
            }
            let next = at
                .entry(k.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            let Value::Object(m) = next else { break };
            at = m;
        }
    }
    Value::Object(out)
}

/// Apply `q` to `items`.
///
/// # Errors
/// 400 for an invalid parameter, a bad regex or a page out of range.
pub fn apply(items: Vec<Value>, q: &ListQuery) -> Result<Value, ApiError> {
    let total = items.len() as u64;
    let mut items = items;
    // As in RabbitMQ, the name filter belongs to pagination: without `page` it is ignored.
    if let Some(name) = q
        .name
        .as_deref()
        .filter(|n| !n.is_empty() && q.page.is_some())
    {
        if boolean("use_regex", q.use_regex.as_deref())? {
            let re = regex_lite(name)?;
            items.retain(|i| i.get("name").and_then(Value::as_str).is_some_and(&re));
        } else {
            // A case-insensitive substring, as RabbitMQ matches it.
            let needle = name.to_lowercase();
            items.retain(|i| {
                i.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| n.to_lowercase().contains(&needle))
            });
        }
    }
    let filtered = items.len() as u64;
    if let Some(sort) = q.sort.as_deref().filter(|s| !s.is_empty()) {
        items.sort_by(|a, b| compare(field(a, sort), field(b, sort)));
    }
    if boolean("sort_reverse", q.sort_reverse.as_deref())? {
        items.reverse();
    }
    if let Some(columns) = q.columns.as_deref().filter(|c| !c.is_empty()) {
        let columns: Vec<&str> = columns.split(',').map(str::trim).collect();
        items = items.iter().map(|i| project(i, &columns)).collect();
    }
    let Some(page) = q.page.as_deref() else {
        return Ok(Value::Array(items));
    };
    let page = positive("page", page)?;
    let page_size = match q.page_size.as_deref() {
        Some(s) => positive("page_size", s)?,
        None => PAGE_SIZE_DEFAULT,
    };
    if page_size > PAGE_SIZE_MAX {
        return Err(ApiError::bad_request(format!(
            "page_size must be at most {PAGE_SIZE_MAX}"
        )));
    }
    let page_count = filtered.div_ceil(page_size).max(1);
    if page > page_count {
        return Err(ApiError::bad_request("page out of range"));
    }
    let start = usize::try_from((page - 1) * page_size).unwrap_or(usize::MAX);
    let on_page: Vec<Value> = items
        .into_iter()
        .skip(start)
        .take(usize::try_from(page_size).unwrap_or(usize::MAX))
        .collect();
    Ok(json!({
        "filtered_count": filtered,
        "item_count": on_page.len(),
        "items": on_page,
        "page": page,
        "page_count": page_count,
        "page_size": page_size,
        "total_count": total,
    }))
}

fn regex_lite(pattern: &str) -> Result<impl Fn(&str) -> bool, ApiError> {
    let re = regex::Regex::new(pattern)
        .map_err(|e| ApiError::bad_request(format!("invalid regular expression: {e}")))?;
    Ok(move |s: &str| re.is_match(s))
}

/// The layer: GET responses that are JSON arrays get the list parameters applied.
pub async fn layer(req: Request, next: Next) -> Response {
    let query = (req.method() == Method::GET)
        .then(|| {
            axum::extract::Query::<ListQuery>::try_from_uri(req.uri())
                .map(|q| q.0)
                .map_err(|e| ApiError::bad_request(e.to_string()))
        })
        .transpose();
    let query = match query {
        Ok(Some(q)) if q.any() => q,
        Ok(_) => return next.run(req).await,
        Err(e) => return e.into_response(),
    };
    let resp = next.run(req).await;
    if resp.status() != StatusCode::OK {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Array(items)) => match apply(items, &query) {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        },
        _ => Response::from_parts(parts, axum::body::Body::from(bytes)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    fn q(
        page: Option<&str>,
        size: Option<&str>,
        name: Option<&str>,
        sort: Option<&str>,
    ) -> ListQuery {
        ListQuery {
            page: page.map(str::to_string),
            page_size: size.map(str::to_string),
            name: name.map(str::to_string),
            sort: sort.map(str::to_string),
            ..ListQuery::default()
        }
    }

    fn items() -> Vec<Value> {
        (0..5)
            .map(|i| json!({"name": format!("q{i}"), "messages": 10 - i, "stats": {"x": i}}))
            .collect()
    }

    #[test]
    fn pages_filters_sorts_and_projects() {
        let v = apply(items(), &q(Some("2"), Some("2"), None, Some("messages"))).unwrap();
        assert_eq!(v["page_count"], 3);
        assert_eq!(v["total_count"], 5);
        assert_eq!(v["item_count"], 2);
        assert_eq!(v["items"][0]["name"], "q2", "sorted by messages ascending");
        let v = apply(items(), &q(Some("1"), None, Some("q3"), None)).unwrap();
        assert_eq!(v["filtered_count"], 1);
        let v = apply(items(), &q(None, None, Some("q3"), None)).unwrap();
        assert_eq!(
            v.as_array().unwrap().len(),
            5,
            "no page, no name filter (RabbitMQ)"
        );
        let mut cols = q(None, None, None, None);
        cols.columns = Some("name,stats.x".into());
        let v = apply(items(), &cols).unwrap();
        assert_eq!(v[1], json!({"name": "q1", "stats": {"x": 1}}));
        assert!(apply(items(), &q(Some("4"), Some("2"), None, None)).is_err());
        assert!(apply(items(), &q(Some("1"), Some("501"), None, None)).is_err());
        assert!(apply(items(), &q(Some("0"), None, None, None)).is_err());
    }
}
