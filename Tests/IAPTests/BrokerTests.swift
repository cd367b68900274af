import Testing

/// Every test that uses the test broker and leaves it (and the cluster) as it found it: one at a
/// time, each with queues of its own, beside `DisruptiveTests`. Five minutes a test.
@Suite(.serialized, .timeLimit(.minutes(5)))
struct BrokerTests {}

/// The fault drills and everything on the three-node cluster: one at a time, beside
/// `BrokerTests`. They break brokers on purpose (a cluster node killed or cut off, a node
/// stopped: the one the run starts for that drill alone, `IAP_TEST_DRILL_AMQP_URL`) and push
/// thousands of purchases through real processes; two such at once would break each other's
/// broker or starve each other's bounds, while one beside the ordinary tests uses the second
/// core those leave idle. Five minutes a test: the drills on a cluster start three nodes first.
@Suite(.serialized, .timeLimit(.minutes(5)))
struct DisruptiveTests {}
