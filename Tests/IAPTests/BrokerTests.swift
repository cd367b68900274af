import Testing

/// Every test that uses the test broker. Serialized, because one of them stops and
/// starts the node; each test still has queues of its own. Five minutes a test: the drills on a
/// cluster of their own start three nodes first.
@Suite(.serialized, .timeLimit(.minutes(5)))
struct BrokerTests {}
