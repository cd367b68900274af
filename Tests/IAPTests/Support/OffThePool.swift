import Foundation

/// Runs blocking work (a child process to its end, a sleep) on a thread of its own while the
/// calling task waits.
///
/// The tests run side by side in one process with the in-process servers they start, and this
/// machine's cooperative pool has one thread per core. A test that blocked one of them for the
/// seconds a RabbitMQ node takes to start would leave the servers no thread to answer or to
/// time a slow body out, and tests bounded in time would fail for it.
func offThePool<T: Sendable>(_ work: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread { continuation.resume(with: Result { try work() }) }.start()
    }
}

extension Process {
    /// Waits for the process to end without holding a cooperative thread.
    func exited() async {
        _ = try? await offThePool { [self] in waitUntilExit() }
    }
}
