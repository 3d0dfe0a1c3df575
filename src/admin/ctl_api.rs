//! `warren ctl` verbs for users, vhosts, permissions, topic permissions, limits and policies,
//! carried out through the management API (called in process over the admin socket), with
//! rabbitmqctl's output and exit codes.
//!
//! The API does the work and the validation; this module adds what rabbitmqctl promises on
//! top of it: `add_user` refuses an existing user (the API's PUT would update it), a missing
//! user or vhost gets rabbitmqctl's exit code (67, 69, or 65 where rabbitmqctl uses it), and
//! listings print as tab-separated tables.

use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};
use warren_broker::users::UserError;

use super::client::{api_request, percent_segment as seg};
use super::command::CtlCommand;

/// rabbitmqctl's "data error" for what a verb's API call refused (bad pattern, bad type).
const EX_DATAERR: u8 = 65;
/// rabbitmqctl's "usage" code (an illegal column, an unsupported queue type).
const EX_USAGE: u8 = 64;

/// The API as the local administrator.
struct Api<'a> {
    data_dir: &'a Path,
}

impl Api<'_> {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<(u16, Value)> {
        api_request(self.data_dir, method, path, body, Vec::new())
    }

    fn get(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        self.call("GET", path, None)
    }

    fn exists(&self, path: &str) -> anyhow::Result<bool> {
        Ok(self.get(path)?.0 == 200)
    }

    fn user(&self, name: &str) -> anyhow::Result<Option<Value>> {
        let (status, body) = self.get(&format!("/api/users/{}", seg(name)))?;
        Ok((status == 200).then_some(body))
    }

    fn vhost_exists(&self, name: &str) -> anyhow::Result<bool> {
        self.exists(&format!("/api/vhosts/{}", seg(name)))
    }
}

/// Print rabbitmqctl's error and return its exit code.
fn fail(message: &str, code: u8) -> u8 {
    eprintln!("Error:\n{message}");
    code
}

fn user_fail(e: &UserError) -> u8 {
    fail(&e.to_string(), super::client::exit_code(e))
}

fn no_user(name: &str) -> u8 {
    user_fail(&UserError::NoSuchUser(name.to_string()))
}

fn no_vhost(name: &str) -> u8 {
    user_fail(&UserError::NoSuchVhost(name.to_string()))
}

/// The API's answer to a change: success, or its reason with `code`.
fn done(status: u16, body: &Value, code: u8) -> u8 {
    if status < 300 {
        0
    } else {
        fail(body["reason"].as_str().unwrap_or("failed"), code)
    }
}

/// A rabbitmqctl table: the header (omitted for an empty listing, as rabbitmqctl does), then
/// tab-separated rows.
fn table(header: &[&str], rows: &[Vec<String>]) -> u8 {
    if !rows.is_empty() {
        println!("{}", header.join("\t"));
    }
    for r in rows {
        println!("{}", r.join("\t"));
    }
    0
}

fn text(v: &Value, key: &str) -> String {
    match &v[key] {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Rows of `fields` from a JSON array.
fn rows(list: &Value, fields: &[&str]) -> Vec<Vec<String>> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|item| fields.iter().map(|f| text(item, f)).collect())
        .collect()
}

fn tags_of(user: &Value) -> Vec<String> {
    match &user["tags"] {
        Value::Array(a) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        Value::String(s) => s
            .split(',')
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    }
}

/// Limits a verb may set, per owner kind (the API's limit names).
const VHOST_LIMITS: &[&str] = &["max-connections", "max-queues"];
const USER_LIMITS: &[&str] = &["max-connections", "max-channels"];

/// Make `owner`'s limits exactly `wanted` (RabbitMQ's set_*_limits replaces the definition):
/// PUT each given, DELETE each other known one.
fn replace_limits(
    api: &Api<'_>,
    base: &str,
    known: &[&str],
    wanted: &serde_json::Map<String, Value>,
) -> anyhow::Result<u8> {
    if let Some(bad) = wanted.keys().find(|k| !known.contains(&k.as_str())) {
        return Ok(fail(&format!("unknown limit '{bad}'"), EX_DATAERR));
    }
    for name in known {
        let path = format!("{base}/{name}");
        let (status, body) = match wanted.get(*name) {
            Some(v) => api.call("PUT", &path, Some(json!({"value": v})))?,
            None => api.call("DELETE", &path, None)?,
        };
        // Clearing a limit that is not set is fine.
        if status >= 300 && status != 404 {
            return Ok(done(status, &body, EX_DATAERR));
        }
    }
    Ok(0)
}

/// Make `vhost`'s limits exactly `wanted`.
fn set_vhost_limits(
    api: &Api<'_>,
    vhost: &str,
    wanted: &serde_json::Map<String, Value>,
) -> anyhow::Result<u8> {
    if !api.vhost_exists(vhost)? {
        return Ok(no_vhost(vhost));
    }
    replace_limits(
        api,
        &format!("/api/vhost-limits/{}", seg(vhost)),
        VHOST_LIMITS,
        wanted,
    )
}

/// The limits of a `/api/*-limits/{owner}` answer, `{}` when none are set.
fn limits_value(list: &Value) -> Value {
    list.as_array()
        .and_then(|a| a.first())
        .map_or_else(|| json!({}), |e| e["value"].clone())
}

fn json_object(text: &str, what: &str) -> anyhow::Result<serde_json::Map<String, Value>> {
    serde_json::from_str(text).with_context(|| format!("{what} must be a JSON object"))
}

/// Carry out `command` if it is one of this module's verbs; `None` for the others.
pub fn run(data_dir: &Path, command: &CtlCommand) -> Option<anyhow::Result<u8>> {
    let api = Api { data_dir };
    let result = match command {
        CtlCommand::AddUser { name, password } => add_user(&api, name, password),
        CtlCommand::DeleteUser { name } => api
            .call("DELETE", &format!("/api/users/{}", seg(name)), None)
            .map(|(status, body)| match status {
                404 => no_user(name),
                s => done(s, &body, EX_DATAERR),
            }),
        CtlCommand::ChangePassword { name, password } => update_user(
            &api,
            name,
            |user| json!({"password": password, "tags": tags_of(user)}),
        ),
        CtlCommand::SetUserTags { name, tags } => {
            update_user(&api, name, |_| json!({"tags": tags.join(",")}))
        }
        CtlCommand::ListUsers => api.get("/api/users").map(|(_, list)| {
            let rows: Vec<Vec<String>> = list
                .as_array()
                .into_iter()
                .flatten()
                .map(|u| vec![text(u, "name"), format!("[{}]", tags_of(u).join(", "))])
                .collect();
            table(&["user", "tags"], &rows)
        }),
        CtlCommand::SetPermissions {
            user,
            configure,
            write,
            read,
            vhost,
        } => grant(&api, PERMISSIONS, vhost, user, [configure, write, read]),
        CtlCommand::ClearPermissions { user, vhost } => {
            revoke(&api, &grant_path(PERMISSIONS, vhost, user), vhost, user)
        }
        CtlCommand::ListPermissions { vhost } => list_grants(&api, PERMISSIONS, By::Vhost(vhost)),
        CtlCommand::ListUserPermissions { user } => list_grants(&api, PERMISSIONS, By::User(user)),
        CtlCommand::SetTopicPermissions {
            user,
            exchange,
            write,
            read,
            vhost,
        } => grant(&api, TOPIC, vhost, user, [exchange, write, read]),
        CtlCommand::ClearTopicPermissions {
            user,
            exchange,
            vhost,
        } => {
            let mut path = grant_path(TOPIC, vhost, user);
            if let Some(x) = exchange {
                path.push_str(&format!("?exchange={}", seg(x)));
            }
            revoke(&api, &path, vhost, user)
        }
        CtlCommand::ListTopicPermissions { vhost } => list_grants(&api, TOPIC, By::Vhost(vhost)),
        CtlCommand::ListUserTopicPermissions { user } => list_grants(&api, TOPIC, By::User(user)),
        CtlCommand::AddVhost {
            name,
            default_queue_type,
        } => add_vhost(&api, name, default_queue_type.as_deref()),
        CtlCommand::UpdateVhostMetadata {
            name,
            default_queue_type,
        } => update_vhost(&api, name, default_queue_type.as_deref()),
        CtlCommand::DeleteVhost { name } => api
            .call("DELETE", &format!("/api/vhosts/{}", seg(name)), None)
            .map(|(status, body)| match status {
                // rabbitmqctl's code for a missing vhost here is 65, not 69.
                404 => fail(&format!("Virtual host '{name}' does not exist"), EX_DATAERR),
                s => done(s, &body, EX_DATAERR),
            }),
        CtlCommand::ListVhosts { columns } => list_vhosts(&api, columns),
        CtlCommand::SetVhostLimits { definition, vhost } => {
            json_object(definition, "limits (max-connections, max-queues)")
                .and_then(|wanted| set_vhost_limits(&api, vhost, &wanted))
        }
        CtlCommand::ClearVhostLimits { vhost } => {
            set_vhost_limits(&api, vhost, &serde_json::Map::new())
        }
        CtlCommand::ListVhostLimits { vhost } => api
            .get(&format!("/api/vhost-limits/{}", seg(vhost)))
            .map(|(status, list)| match status {
                200 => {
                    println!("{}", limits_value(&list));
                    0
                }
                _ => fail(
                    &format!("Virtual host '{vhost}' does not exist"),
                    EX_DATAERR,
                ),
            }),
        CtlCommand::SetUserLimits { name, definition } => (|| {
            let wanted = json_object(definition, "limits (max-connections, max-channels)")?;
            if api.user(name)?.is_none() {
                return Ok(no_user(name));
            }
            replace_limits(
                &api,
                &format!("/api/user-limits/{}", seg(name)),
                USER_LIMITS,
                &wanted,
            )
        })(),
        CtlCommand::ClearUserLimits { name, limit } => (|| {
            if api.user(name)?.is_none() {
                return Ok(no_user(name));
            }
            let names: Vec<&str> = match limit.as_str() {
                "all" => USER_LIMITS.to_vec(),
                one => vec![one],
            };
            for n in names {
                let path = format!("/api/user-limits/{}/{}", seg(name), seg(n));
                let (status, body) = api.call("DELETE", &path, None)?;
                if status >= 300 && status != 404 {
                    return Ok(done(status, &body, EX_DATAERR));
                }
            }
            Ok(0)
        })(),
        CtlCommand::ListUserLimits { user } => api
            .get(&format!("/api/user-limits/{}", seg(user)))
            .map(|(status, list)| match status {
                200 => {
                    println!("{}", limits_value(&list));
                    0
                }
                _ => no_user(user),
            }),
        CtlCommand::SetPolicy(args) => set_policy(&api, "policies", args),
        CtlCommand::SetOperatorPolicy(args) => set_policy(&api, "operator-policies", args),
        CtlCommand::ClearPolicy { name, vhost } => clear_policy(&api, "policies", name, vhost),
        CtlCommand::ClearOperatorPolicy { name, vhost } => {
            clear_policy(&api, "operator-policies", name, vhost)
        }
        CtlCommand::ListPolicies { vhost } => api
            .get(&format!("/api/policies/{}", seg(vhost)))
            .and_then(|(status, list)| match status {
                200 => {
                    println!("{}", serde_json::to_string_pretty(&list)?);
                    Ok(0)
                }
                _ => Ok(no_vhost(vhost)),
            }),
        _ => return None,
    };
    Some(result)
}

/// PUT a policy into `set` (`policies` or `operator-policies`).
fn set_policy(api: &Api<'_>, set: &str, a: &super::command::PolicyArgs) -> anyhow::Result<u8> {
    let definition = json_object(&a.definition, "the definition")?;
    let (status, body) = api.call(
        "PUT",
        &format!("/api/{set}/{}/{}", seg(&a.vhost), seg(&a.name)),
        Some(json!({"pattern": a.pattern, "definition": definition,
                    "priority": a.priority, "apply-to": a.apply_to})),
    )?;
    Ok(match status {
        404 => no_vhost(&a.vhost),
        s => done(s, &body, 1),
    })
}

fn clear_policy(api: &Api<'_>, set: &str, name: &str, vhost: &str) -> anyhow::Result<u8> {
    let (status, body) = api.call(
        "DELETE",
        &format!("/api/{set}/{}/{}", seg(vhost), seg(name)),
        None,
    )?;
    Ok(match status {
        404 if !api.vhost_exists(vhost)? => no_vhost(vhost),
        404 => fail(&format!("no policy '{name}' in vhost '{vhost}'"), 1),
        s => done(s, &body, 1),
    })
}

fn add_user(api: &Api<'_>, name: &str, password: &str) -> anyhow::Result<u8> {
    // rabbitmqctl refuses an existing user; the API's PUT would update it.
    if api.user(name)?.is_some() {
        return Ok(user_fail(&UserError::Exists(name.to_string())));
    }
    let (status, body) = api.call(
        "PUT",
        &format!("/api/users/{}", seg(name)),
        Some(json!({"password": password, "tags": ""})),
    )?;
    Ok(done(status, &body, EX_DATAERR))
}

/// PUT a new body for an existing user (built from its current record).
fn update_user(api: &Api<'_>, name: &str, body: impl Fn(&Value) -> Value) -> anyhow::Result<u8> {
    let Some(user) = api.user(name)? else {
        return Ok(no_user(name));
    };
    let (status, reply) = api.call(
        "PUT",
        &format!("/api/users/{}", seg(name)),
        Some(body(&user)),
    )?;
    Ok(done(status, &reply, EX_DATAERR))
}

/// Which of `vhost` and `user` is missing, as rabbitmqctl reports it (the vhost first).
fn missing_party(api: &Api<'_>, vhost: &str, user: &str) -> anyhow::Result<Option<u8>> {
    if !api.vhost_exists(vhost)? {
        return Ok(Some(no_vhost(vhost)));
    }
    if api.user(user)?.is_none() {
        return Ok(Some(no_user(user)));
    }
    Ok(None)
}

/// `/api/{permissions|topic-permissions}/{vhost}/{user}`.
fn grant_path((kind, _): Grants, vhost: &str, user: &str) -> String {
    format!("/api/{kind}/{}/{}", seg(vhost), seg(user))
}

/// Set a grant: `values` are the kind's three fields (configure/exchange, write, read).
fn grant(
    api: &Api<'_>,
    grants: Grants,
    vhost: &str,
    user: &str,
    values: [&String; 3],
) -> anyhow::Result<u8> {
    if let Some(code) = missing_party(api, vhost, user)? {
        return Ok(code);
    }
    let body: serde_json::Map<String, Value> = grants
        .1
        .iter()
        .zip(values)
        .map(|(k, v)| ((*k).to_string(), Value::from(v.as_str())))
        .collect();
    let path = grant_path(grants, vhost, user);
    let (status, reply) = api.call("PUT", &path, Some(Value::Object(body)))?;
    // What the API refuses past that is a pattern that does not compile.
    let code = super::client::exit_code(&UserError::BadPattern(String::new(), String::new()));
    Ok(done(status, &reply, code))
}

fn revoke(api: &Api<'_>, path: &str, vhost: &str, user: &str) -> anyhow::Result<u8> {
    if let Some(code) = missing_party(api, vhost, user)? {
        return Ok(code);
    }
    let (status, reply) = api.call("DELETE", path, None)?;
    // Clearing what is not set succeeds, as in rabbitmqctl.
    Ok(if status == 404 {
        0
    } else {
        done(status, &reply, EX_DATAERR)
    })
}

/// A kind of grant: its API path segment and the columns after the owner's.
type Grants = (&'static str, [&'static str; 3]);
const PERMISSIONS: Grants = ("permissions", ["configure", "write", "read"]);
const TOPIC: Grants = ("topic-permissions", ["exchange", "write", "read"]);

/// Whose grants a listing shows.
enum By<'a> {
    Vhost(&'a str),
    User(&'a str),
}

/// A permission listing, by vhost (first column `user`) or by user (first column `vhost`). A
/// missing vhost is rabbitmqctl's 65; a missing user lists nothing.
fn list_grants(api: &Api<'_>, (kind, cols): Grants, by: By<'_>) -> anyhow::Result<u8> {
    let (path, first) = match by {
        By::Vhost(v) => (format!("/api/vhosts/{}/{kind}", seg(v)), "user"),
        By::User(u) => (format!("/api/users/{}/{kind}", seg(u)), "vhost"),
    };
    let columns = [first, cols[0], cols[1], cols[2]];
    let (status, list) = api.get(&path)?;
    Ok(match (status, by) {
        (200, _) => table(&columns, &rows(&list, &columns)),
        (404, By::Vhost(vhost)) => fail(
            &format!("Virtual host '{vhost}' does not exist"),
            EX_DATAERR,
        ),
        (404, By::User(_)) => 0,
        (s, _) => done(s, &list, EX_DATAERR),
    })
}

/// PUT the vhost with `queue_type` as its default (None: none); a queue type rabbitmqctl does
/// not know is its usage code.
fn put_vhost(api: &Api<'_>, name: &str, queue_type: Option<&str>) -> anyhow::Result<u8> {
    let (status, reply) = api.call(
        "PUT",
        &format!("/api/vhosts/{}", seg(name)),
        Some(json!({"default_queue_type": queue_type})),
    )?;
    if status < 300 {
        return Ok(0);
    }
    let reason = reply["reason"].as_str().unwrap_or("failed");
    let code = if reason.contains("default queue type") {
        EX_USAGE
    } else {
        EX_DATAERR
    };
    Ok(fail(reason, code))
}

fn add_vhost(api: &Api<'_>, name: &str, queue_type: Option<&str>) -> anyhow::Result<u8> {
    // An existing vhost is left as it is (the API's PUT would update its metadata).
    if api.vhost_exists(name)? {
        return Ok(0);
    }
    put_vhost(api, name, queue_type)
}

fn update_vhost(api: &Api<'_>, name: &str, queue_type: Option<&str>) -> anyhow::Result<u8> {
    if !api.vhost_exists(name)? {
        return Ok(no_vhost(name));
    }
    // Keys not given are left as they are, as in rabbitmqctl.
    match queue_type {
        Some(t) => put_vhost(api, name, Some(t)),
        None => Ok(0),
    }
}

fn list_vhosts(api: &Api<'_>, columns: &[String]) -> anyhow::Result<u8> {
    let columns: Vec<&str> = if columns.is_empty() {
        vec!["name"]
    } else {
        columns.iter().map(String::as_str).collect()
    };
    if let Some(bad) = columns
        .iter()
        .find(|c| !["name", "default_queue_type"].contains(c))
    {
        return Ok(fail(&format!("Illegal column: {bad}"), EX_USAGE));
    }
    let (_, list) = api.get("/api/vhosts")?;
    let rows: Vec<Vec<String>> = list
        .as_array()
        .into_iter()
        .flatten()
        .map(|vh| {
            columns
                .iter()
                .map(|c| match *c {
                    "default_queue_type" => vh["default_queue_type"]
                        .as_str()
                        .unwrap_or("undefined")
                        .to_string(),
                    _ => text(vh, "name"),
                })
                .collect()
        })
        .collect();
    Ok(table(&columns, &rows))
}
