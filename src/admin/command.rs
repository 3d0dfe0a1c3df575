//! The `warren ctl` command line: the subcommands (rabbitmqctl's names, flags and help) and
//! the line rabbitmqctl prints before carrying one out.

/// The arguments of `set_policy` and `set_operator_policy`.
#[derive(Debug, clap::Args)]
pub struct PolicyArgs {
    /// Policy name.
    pub name: String,
    /// Regular expression matched against queue / exchange names.
    pub pattern: String,
    /// JSON object of settings.
    pub definition: String,
    /// Higher wins when several match.
    #[arg(long, default_value_t = 0)]
    pub priority: i32,
    /// all, queues, classic_queues, quorum_queues or exchanges.
    #[arg(long = "apply-to", default_value = "all")]
    pub apply_to: String,
    /// Vhost.
    #[arg(short = 'p', long, default_value = "/")]
    pub vhost: String,
}

/// The options of `redrive_queue`.
#[derive(Debug, clap::Args)]
pub struct RedriveArgs {
    /// The queue to move messages out of (a dead-letter queue).
    pub queue: String,
    /// Move into this queue instead of each message's x-death origin.
    #[arg(long)]
    pub to: Option<String>,
    /// Move at most this many messages.
    #[arg(long = "max-messages")]
    pub max_messages: Option<u64>,
    /// Messages per second at most [default: 500].
    #[arg(long)]
    pub rate: Option<u32>,
    /// Only messages that last died in this queue.
    #[arg(long)]
    pub origin: Option<String>,
    /// Only messages that last died for this reason (rejected, expired, maxlen,
    /// delivery_limit).
    #[arg(long)]
    pub reason: Option<String>,
    /// Only messages with this routing key.
    #[arg(long = "routing-key")]
    pub routing_key: Option<String>,
    /// Only messages with this header value: NAME=VALUE (repeatable).
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// Print the started task and return without waiting for it.
    #[arg(long = "no-wait")]
    pub no_wait: bool,
    /// Vhost.
    #[arg(short = 'p', long, default_value = "/")]
    pub vhost: String,
}

/// The options of `add_super_stream` (rabbitmq-streams' names).
#[derive(Debug, clap::Args)]
pub struct SuperStreamArgs {
    /// The super stream's name (its exchange; partitions are NAME-0 .. or NAME-KEY).
    pub name: String,
    /// Number of partitions (streams NAME-0 .. NAME-(N-1), routing keys 0 .. N-1).
    #[arg(long)]
    pub partitions: Option<u32>,
    /// Comma-separated binding keys instead of --partitions (streams NAME-KEY).
    #[arg(long = "binding-keys", alias = "routing-keys")]
    pub binding_keys: Option<String>,
    /// Each partition's x-max-length-bytes.
    #[arg(long = "max-length-bytes")]
    pub max_length_bytes: Option<u64>,
    /// Each partition's x-max-age (for example 7D, 1h).
    #[arg(long = "max-age")]
    pub max_age: Option<String>,
    /// Each partition's x-stream-max-segment-size-bytes.
    #[arg(long = "stream-max-segment-size-bytes")]
    pub stream_max_segment_size_bytes: Option<u64>,
    /// Where partition leaders go (client-local, balanced) [default: balanced].
    #[arg(long = "leader-locator")]
    pub leader_locator: Option<String>,
    /// Each partition's x-initial-cluster-size.
    #[arg(long = "initial-cluster-size")]
    pub initial_cluster_size: Option<u32>,
    /// Vhost.
    #[arg(short = 'p', long, default_value = "/")]
    pub vhost: String,
}

/// `warren ctl` subcommands (rabbitmqctl names).
#[derive(Debug, clap::Subcommand)]
#[command(rename_all = "snake_case")]
pub enum CtlCommand {
    /// Set a policy: NAME PATTERN DEFINITION (JSON), e.g.
    /// `set_policy limits '^orders\.' '{"max-length": 1000}' --apply-to queues`. Keys:
    /// message-ttl, expires, max-length, max-length-bytes, overflow, dead-letter-exchange,
    /// dead-letter-routing-key, delivery-limit, alternate-exchange.
    SetPolicy(PolicyArgs),
    /// Remove a policy.
    ClearPolicy {
        /// Policy name.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List policies as JSON.
    ListPolicies {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Create a user (no tags, no permissions).
    AddUser {
        /// User name.
        name: String,
        /// Password.
        password: String,
    },
    /// Delete a user and its permissions.
    DeleteUser {
        /// User name.
        name: String,
    },
    /// Set a user's password.
    ChangePassword {
        /// User name.
        name: String,
        /// New password.
        password: String,
    },
    /// Replace a user's tags (none clears them).
    SetUserTags {
        /// User name.
        name: String,
        /// Tags: administrator, monitoring, policymaker, management, impersonator, ...
        tags: Vec<String>,
    },
    /// List users and their tags.
    ListUsers,
    /// Check a user's password.
    AuthenticateUser {
        /// User name.
        name: String,
        /// Password.
        password: String,
    },
    /// Grant a user configure / write / read patterns in a vhost.
    SetPermissions {
        /// User name.
        user: String,
        /// Pattern for declare / delete.
        configure: String,
        /// Pattern for publish / bind destination.
        write: String,
        /// Pattern for consume / get / purge / bind source.
        read: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a user's permissions in a vhost.
    ClearPermissions {
        /// User name.
        user: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List the permissions in a vhost.
    ListPermissions {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List a user's permissions in every vhost.
    ListUserPermissions {
        /// User name.
        user: String,
    },
    /// Create a vhost (no-op if it exists).
    AddVhost {
        /// Vhost name.
        name: String,
        /// Type of queues declared without x-queue-type: classic or quorum.
        #[arg(long = "default-queue-type")]
        default_queue_type: Option<String>,
    },
    /// Change a vhost's metadata.
    UpdateVhostMetadata {
        /// Vhost name.
        name: String,
        /// Type of queues declared without x-queue-type: classic or quorum.
        #[arg(long = "default-queue-type")]
        default_queue_type: Option<String>,
    },
    /// Delete a vhost with everything in it; its connections are closed.
    DeleteVhost {
        /// Vhost name.
        name: String,
    },
    /// List vhosts; columns: name (default), default_queue_type.
    ListVhosts {
        /// Columns to show.
        columns: Vec<String>,
    },
    /// Set a vhost's limits, e.g. `'{"max-connections": 100, "max-queues": 10}'` (a negative
    /// value means unlimited).
    SetVhostLimits {
        /// JSON object with max-connections and/or max-queues.
        definition: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a vhost's limits.
    ClearVhostLimits {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Print a vhost's limits as JSON.
    ListVhostLimits {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Set a user's limits, e.g. `'{"max-connections": 10, "max-channels": 100}'`.
    SetUserLimits {
        /// User name.
        name: String,
        /// JSON object with max-connections and/or max-channels.
        definition: String,
    },
    /// Remove one limit of a user (max-connections, max-channels) or all of them.
    ClearUserLimits {
        /// User name.
        name: String,
        /// The limit, or `all`.
        limit: String,
    },
    /// Print a user's limits as JSON.
    ListUserLimits {
        /// User name.
        #[arg(long)]
        user: String,
    },
    /// Constrain a user's routing keys (write) and binding keys (read) on a topic exchange;
    /// `{username}` and `{vhost}` in the patterns stand for the names.
    SetTopicPermissions {
        /// User name.
        user: String,
        /// The topic exchange.
        exchange: String,
        /// Pattern for routing keys of publishes.
        write: String,
        /// Pattern for binding keys.
        read: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a user's topic permissions (on one exchange, or all) in a vhost.
    ClearTopicPermissions {
        /// User name.
        user: String,
        /// The exchange (all when omitted).
        exchange: Option<String>,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List the topic permissions in a vhost.
    ListTopicPermissions {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List a user's topic permissions.
    ListUserTopicPermissions {
        /// User name.
        user: String,
    },
    /// Change the memory high watermark at run time: `<fraction>` of RAM, or
    /// `absolute <size>` ("2GB", "512MiB", bytes). Not persisted, as in RabbitMQ.
    SetVmMemoryHighWatermark {
        /// A fraction, or `absolute`.
        value: String,
        /// The size after `absolute`.
        size: Option<String>,
    },
    /// Change the disk free limit at run time: `<size>`, or `mem_relative <fraction>` of RAM.
    /// Not persisted, as in RabbitMQ.
    SetDiskFreeLimit {
        /// A size, or `mem_relative`.
        value: String,
        /// The fraction after `mem_relative`.
        fraction: Option<String>,
    },
    /// Show the resource alarms in effect (rabbitmq-diagnostics alarms).
    Alarms,
    /// List queues; columns are the management API's queue fields [default: name messages].
    ListQueues {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// List exchanges [default columns: name type].
    ListExchanges {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// List bindings [default columns: source_name source_kind destination_name
    /// destination_kind routing_key arguments].
    ListBindings {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// List connections [default columns: user peer_host peer_port state].
    ListConnections {
        /// Columns.
        columns: Vec<String>,
    },
    /// List channels [default columns: pid user consumer_count messages_unacknowledged].
    ListChannels {
        /// Columns.
        columns: Vec<String>,
    },
    /// List consumers [default columns: queue_name consumer_tag ack_required prefetch_count
    /// arguments].
    ListConsumers {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// Remove every ready message from a queue.
    PurgeQueue {
        /// Queue.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Delete a queue with its messages.
    DeleteQueue {
        /// Queue.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Close a connection (320 CONNECTION_FORCED with the explanation).
    CloseConnection {
        /// The connection's id: its `pid` (or `name`) in list_connections (`peer -> local`).
        name: String,
        /// Reason given to the client.
        explanation: String,
    },
    /// The node's status: version, uptime, listeners, alarms, memory, disk, file descriptors
    /// and object totals.
    Status,
    /// Set an operator policy (limits that cap users' policies and queue arguments): NAME
    /// PATTERN DEFINITION, e.g. `set_operator_policy cap '.*' '{"max-length": 100000}'`.
    /// Keys: message-ttl, expires, max-length, max-length-bytes, delivery-limit.
    SetOperatorPolicy(PolicyArgs),
    /// Remove an operator policy.
    ClearOperatorPolicy {
        /// Policy name.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List operator policies [columns: vhost name pattern apply-to definition priority].
    ListOperatorPolicies {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Write the node's definitions (RabbitMQ's JSON format) to a file, or `-` for stdout.
    ExportDefinitions {
        /// Target file.
        path: String,
    },
    /// Import definitions (RabbitMQ's JSON format) from a file.
    ImportDefinitions {
        /// Source file.
        path: String,
    },
    /// Remove a stopped node from the cluster for good (from the metadata group and every
    /// quorum queue's members). It cannot join again under that name.
    ForgetClusterNode {
        /// Node name.
        node: String,
    },
    /// Make this node (running alone, with --node-name and --cluster-secret, holding nothing
    /// of its own) join the running cluster of SEEDS (`name@host:port,...`, their cluster
    /// ports): it restarts into the cluster. Answers once it runs as a member.
    JoinCluster {
        /// Nodes of the cluster to join: `name@host:port,...`.
        seeds: String,
        /// Where the other nodes reach this one's cluster port [default: its listen address].
        #[arg(long)]
        address: Option<String>,
    },
    /// The cluster's name, its nodes, and which of them this node hears from.
    ClusterStatus {
        /// `json` for one JSON object.
        #[arg(long)]
        formatter: Option<String>,
    },
    /// Move messages out of a dead-letter queue (a redrive): back to the queue each died in
    /// (its x-death), or `--to` a named queue; at most `--rate` a second, up to
    /// `--max-messages`, those the filter options choose. Prints progress until it ends
    /// (`--no-wait`: prints the task and returns). Interrupted, nothing is lost or doubled:
    /// run it again to finish.
    RedriveQueue(Box<RedriveArgs>),
    /// List this node's redrives [columns: id vhost source destination status moved
    /// duplicates skipped refused].
    ListRedrives,
    /// Cancel a redrive (the round under way completes).
    CancelRedrive {
        /// The redrive's id (list_redrives).
        id: u64,
    },
    /// Create a super stream (rabbitmq-streams add_super_stream): a direct exchange NAME and
    /// one stream per partition, bound by routing key with x-stream-partition-order.
    AddSuperStream(Box<SuperStreamArgs>),
    /// Delete a super stream: its exchange and every partition stream.
    DeleteSuperStream {
        /// The super stream's name.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Quorum queue membership (rabbitmq-queues): add_member, delete_member, grow, shrink.
    Queues {
        /// The verb.
        #[command(subcommand)]
        command: super::ctl_cluster::QueuesCommand,
    },
}

impl CtlCommand {
    /// The line rabbitmqctl prints before doing it.
    pub(super) fn banner(&self) -> Option<String> {
        Some(match self {
            Self::AddUser { name, .. } => format!("Adding user \"{name}\" ..."),
            Self::DeleteUser { name } => format!("Deleting user \"{name}\" ..."),
            Self::ChangePassword { name, .. } => {
                format!("Changing password for user \"{name}\" ...")
            }
            Self::SetUserTags { name, tags } => {
                format!(
                    "Setting tags for user \"{name}\" to [{}] ...",
                    tags.join(", ")
                )
            }
            Self::ListUsers => "Listing users ...".into(),
            Self::AuthenticateUser { name, .. } => format!("Authenticating user \"{name}\" ..."),
            Self::SetPermissions { user, vhost, .. } => {
                format!("Setting permissions for user \"{user}\" in vhost \"{vhost}\" ...")
            }
            Self::ClearPermissions { user, vhost } => {
                format!("Clearing permissions for user \"{user}\" in vhost \"{vhost}\" ...")
            }
            Self::ListPermissions { vhost } => {
                format!("Listing permissions for vhost \"{vhost}\" ...")
            }
            Self::ListUserPermissions { user } => {
                format!("Listing permissions for user \"{user}\" ...")
            }
            Self::AddVhost { name, .. } => format!("Adding vhost \"{name}\" ..."),
            Self::UpdateVhostMetadata { name, .. } => {
                format!("Updating metadata of vhost \"{name}\" ...")
            }
            Self::DeleteVhost { name } => format!("Deleting vhost \"{name}\" ..."),
            Self::ListVhosts { .. } => "Listing vhosts ...".into(),
            Self::SetVhostLimits { definition, vhost } => {
                format!("Setting vhost limits to \"{definition}\" for vhost \"{vhost}\" ...")
            }
            Self::ClearVhostLimits { vhost } => format!("Clearing vhost \"{vhost}\" limits ..."),
            Self::ListVhostLimits { vhost } => format!("Listing limits for vhost \"{vhost}\" ..."),
            Self::SetUserLimits { name, definition } => {
                format!("Setting user limits to \"{definition}\" for user \"{name}\" ...")
            }
            Self::ClearUserLimits { name, limit } => {
                format!("Clearing \"{limit}\" limit for user \"{name}\" ...")
            }
            Self::ListUserLimits { user } => format!("Listing limits for user \"{user}\" ..."),
            Self::SetTopicPermissions {
                user,
                exchange,
                vhost,
                ..
            } => format!(
                "Setting topic permissions on \"{exchange}\" for user \"{user}\" in vhost \"{vhost}\" ..."
            ),
            Self::ClearTopicPermissions { user, vhost, .. } => {
                format!("Clearing topic permissions for user \"{user}\" in vhost \"{vhost}\" ...")
            }
            Self::ListTopicPermissions { vhost } => {
                format!("Listing topic permissions for vhost \"{vhost}\" ...")
            }
            Self::ListUserTopicPermissions { user } => {
                format!("Listing topic permissions for user \"{user}\" ...")
            }
            Self::SetOperatorPolicy(a) => format!(
                "Setting operator policy override \"{}\" for pattern \"{}\" to \"{}\" with priority \"{}\" ...",
                a.name, a.pattern, a.definition, a.priority
            ),
            Self::ClearOperatorPolicy { name, vhost } => {
                format!("Clearing operator policy \"{name}\" on vhost \"{vhost}\" ...")
            }
            Self::SetVmMemoryHighWatermark { value, size } => match size {
                Some(size) => format!("Setting memory threshold on warren to {size} bytes ..."),
                None => format!("Setting memory threshold on warren to {value} ..."),
            },
            Self::SetDiskFreeLimit { value, fraction } => match fraction {
                Some(f) => {
                    format!("Setting disk free limit on warren to {f} times the total RAM ...")
                }
                None => format!("Setting disk free limit on warren to {value} bytes ..."),
            },
            _ => return None,
        })
    }
}
