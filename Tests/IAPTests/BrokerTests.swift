import Testing
import TestSupport

/// Every test that uses the test broker and leaves it (and the cluster) as it found it: one at a
/// time, each with queues of its own, beside `DisruptiveTests` and `ClusterDrills`. Five minutes
/// a test.
@Suite(.serialized, .timeLimit(.minutes(5)), .teardown)
struct BrokerTests {}

/// The fault drills of one box: one at a time, beside `BrokerTests` and `ClusterDrills`. They
/// break what they run on purpose (a process killed, the node the run starts for these drills
/// alone stopped: `IAP_TEST_DRILL_AMQP_URL`) and push thousands of purchases through real
/// processes; two such at once would break each other's broker or starve each other's bounds.
/// Five minutes a test.
@Suite(.serialized, .timeLimit(.minutes(5)), .teardown)
struct DisruptiveTests {}

/// Everything on the three-node cluster, the drills of several order services on one
/// PostgreSQL store among it: one at a time, beside `BrokerTests` and `DisruptiveTests`. They
/// kill and cut off the cluster's nodes, which nothing else uses. Five minutes a test: some
/// start three nodes first.
@Suite(.serialized, .timeLimit(.minutes(5)), .teardown)
struct ClusterDrills {}
