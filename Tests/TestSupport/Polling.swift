/// Polls `condition` until it holds or `timeout` passes.
package func eventually(
    timeout: Duration = .seconds(20), interval: Duration = .milliseconds(50),
    _ condition: () async throws -> Bool
) async throws -> Bool {
    let deadline = ContinuousClock.now + timeout
    while ContinuousClock.now < deadline {
        if try await condition() { return true }
        try await Task.sleep(for: interval)
    }
    return try await condition()
}
