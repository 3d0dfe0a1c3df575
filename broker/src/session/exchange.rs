//! The exchange class: exchange.declare, exchange.delete, exchange.bind and exchange.unbind
//! (exchange-to-exchange bindings), with their permission checks.

use amq_protocol::protocol::{AMQPClass, exchange};
use warren_amqp::{AmqpError, ReplyCode};

use crate::exchange::ExchangeDecl;
use crate::exchange::{Destination, ExchangeKind};
use crate::node::access::{Perm, Resource};

use super::Call;
use super::common::vhost_up;

/// RabbitMQ's refusal of declaring or deleting the default exchange.
fn default_refused() -> AmqpError {
    AmqpError::channel(
        ReplyCode::AccessRefused,
        "operation not permitted on the default exchange",
    )
}

impl Call<'_> {
    /// exchange.declare: passive (it must exist) or a declaration (created, or checked
    /// equivalent to the existing one).
    pub(super) fn exchange_declare(&mut self, d: exchange::Declare) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
        let name = d.exchange.as_str();
        if d.passive {
            if name.is_empty() {
                return Err(default_refused());
            }
            vhost.check_exchange(name)?;
        } else {
            let delayed = d.kind.as_str() == crate::exchange::DELAYED_TYPE;
            let kind = if delayed {
                // rabbitmq_delayed_message_exchange: the routing type comes from
                // x-delayed-type.
                crate::args::string_arg(&d.arguments, "x-delayed-type")
                    .and_then(|t| ExchangeKind::parse(&t))
                    .ok_or_else(|| {
                        AmqpError::channel(
                            ReplyCode::PreconditionFailed,
                            "Invalid argument, 'x-delayed-type' must be an existing exchange type",
                        )
                    })?
            } else {
                ExchangeKind::parse(d.kind.as_str()).ok_or_else(|| {
                    AmqpError::channel(
                        ReplyCode::PreconditionFailed,
                        format!("unknown exchange type '{}'", d.kind.as_str()),
                    )
                })?
            };
            if name.is_empty() {
                return Err(default_refused());
            }
            ctx.allow(Perm::Configure, Resource::Exchange, name)?;
            vhost_up(ctx)?;
            if let Some(ae) = crate::args::string_arg(&d.arguments, "alternate-exchange") {
                ctx.allow(Perm::Write, Resource::Exchange, &ae)?;
                ctx.allow(Perm::Read, Resource::Exchange, name)?;
            }
            vhost.declare_exchange(
                name,
                ExchangeDecl {
                    kind,
                    durable: d.durable,
                    auto_delete: d.auto_delete,
                    internal: d.internal,
                    delayed,
                    arguments: d.arguments,
                },
                &mut || ctx.on_commit(),
            )?;
        }
        if !d.nowait {
            self.reply(AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                exchange::DeclareOk {},
            )));
        }
        Ok(())
    }

    /// exchange.delete.
    pub(super) fn exchange_delete(&mut self, d: exchange::Delete) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        if d.exchange.as_str().is_empty() {
            return Err(default_refused());
        }
        ctx.allow(Perm::Configure, Resource::Exchange, d.exchange.as_str())?;
        ctx.vhost
            .delete_exchange(d.exchange.as_str(), d.if_unused, &mut || ctx.on_commit())?;
        if !d.nowait {
            self.reply(AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(
                exchange::DeleteOk {},
            )));
        }
        Ok(())
    }

    /// exchange.bind: `destination` receives what `source` routes with the key.
    pub(super) fn exchange_bind(&mut self, b: exchange::Bind) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        ctx.allow(Perm::Write, Resource::Exchange, b.destination.as_str())?;
        ctx.allow(Perm::Read, Resource::Exchange, b.source.as_str())?;
        ctx.allow_topic(Perm::Read, b.source.as_str(), b.routing_key.as_str())?;
        ctx.vhost.bind(
            b.source.as_str(),
            Destination::Exchange(b.destination.as_str().to_string()),
            b.routing_key.as_str(),
            b.arguments,
            &mut || ctx.on_commit(),
        )?;
        if !b.nowait {
            self.reply(AMQPClass::Exchange(exchange::AMQPMethod::BindOk(
                exchange::BindOk {},
            )));
        }
        Ok(())
    }

    /// exchange.unbind.
    pub(super) fn exchange_unbind(&mut self, u: exchange::Unbind) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        ctx.allow(Perm::Write, Resource::Exchange, u.destination.as_str())?;
        ctx.allow(Perm::Read, Resource::Exchange, u.source.as_str())?;
        ctx.allow_topic(Perm::Read, u.source.as_str(), u.routing_key.as_str())?;
        ctx.vhost.unbind(
            u.source.as_str(),
            Destination::Exchange(u.destination.as_str().to_string()),
            u.routing_key.as_str(),
            u.arguments,
            &mut || ctx.on_commit(),
        )?;
        if !u.nowait {
            self.reply(AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(
                exchange::UnbindOk {},
            )));
        }
        Ok(())
    }
}
