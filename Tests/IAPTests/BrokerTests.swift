import Testing

/// Every test that uses the test broker. Serialized, because one of them stops and
/// starts the node; each test still has queues of its own.
@Suite(.serialized, .timeLimit(.minutes(3)))
struct BrokerTests {}
