/// The exchanges, queues and bindings a role needs; declared on every (re)connection.
///
/// Declarations are idempotent as long as the arguments stay the same; changing
/// the arguments of an existing queue is refused by the broker (406) and surfaces
/// as a connection error in the log.
public struct Topology: Sendable, Equatable {
    /// An exchange to declare.
    public struct Exchange: Sendable, Equatable {
        /// Exchange name.
        public var name: String
        /// `direct`, `topic`, `fanout` or `headers`.
        public var type: String
        /// Creates a durable exchange declaration.
        public init(name: String, type: String) {
            self.name = name
            self.type = type
        }
    }

    /// A value in a queue's `x-` arguments.
    public enum ArgumentValue: Sendable, Equatable {
        case string(String)
        case int(Int64)
    }

    /// A durable queue to declare.
    public struct Queue: Sendable, Equatable {
        /// Queue name.
        public var name: String
        /// Queue arguments such as `x-dead-letter-exchange` or `x-message-ttl`.
        public var arguments: [String: ArgumentValue]
        /// Creates a durable, non-exclusive queue declaration.
        public init(name: String, arguments: [String: ArgumentValue] = [:]) {
            self.name = name
            self.arguments = arguments
        }
    }

    /// A binding of a queue to an exchange.
    public struct Binding: Sendable, Equatable {
        /// The bound queue.
        public var queue: String
        /// The exchange it listens to.
        public var exchange: String
        /// The routing key (pattern, for topic exchanges).
        public var routingKey: String
        /// Creates a binding.
        public init(queue: String, exchange: String, routingKey: String) {
            self.queue = queue
            self.exchange = exchange
            self.routingKey = routingKey
        }
    }

    /// Exchanges, declared first.
    public var exchanges: [Exchange]
    /// Queues, declared after the exchanges.
    public var queues: [Queue]
    /// Bindings, declared last.
    public var bindings: [Binding]

    /// Creates a topology.
    public init(exchanges: [Exchange] = [], queues: [Queue] = [], bindings: [Binding] = []) {
        self.exchanges = exchanges
        self.queues = queues
        self.bindings = bindings
    }
}
