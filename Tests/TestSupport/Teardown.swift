import NIOConcurrencyHelpers
package import Testing

/// What a test started and must stop, stopped after it and awaited: each step a test adds with
/// `Teardown.add` runs when the test case ends (passed, failed or thrown), newest first, before
/// the next test of a serialized suite starts. A suite whose tests add steps carries the
/// `.teardown` trait (the broker umbrellas carry it for every suite inside them); a step added
/// outside one is an issue of the test.
package struct Teardown: SuiteTrait, TestTrait, TestScoping {
    /// The steps of the running test case.
    @TaskLocal package static var current: Steps?

    package final class Steps: Sendable {
        private let steps = NIOLockedValueBox<[@Sendable () async -> Void]>([])

        func add(_ step: @escaping @Sendable () async -> Void) { steps.withLockedValue { $0.append(step) } }

        /// Runs every step added so far, newest first, each once.
        func run() async {
            while let step = steps.withLockedValue({ $0.popLast() }) { await step() }
        }
    }

    /// Adds `step` to the running test case's teardown.
    package static func add(_ step: @escaping @Sendable () async -> Void) {
        guard let current else {
            Issue.record("Teardown.add outside a suite with the .teardown trait: the step runs now, unawaited")
            Task { await step() }
            return
        }
        current.add(step)
    }

    package var isRecursive: Bool { true }

    /// A scope of its own for every test case (not one for a whole suite).
    package func scopeProvider(for test: Test, testCase: Test.Case?) -> Self? { testCase == nil ? nil : self }

    package func provideScope(
        for test: Test, testCase: Test.Case?, performing function: @Sendable () async throws -> Void
    ) async throws {
        let steps = Steps()
        try await Self.$current.withValue(steps) {
            do {
                try await function()
            } catch {
                await steps.run()
                throw error
            }
            await steps.run()
        }
    }
}

extension Trait where Self == Teardown {
    /// Stops what each test added with `Teardown.add`, awaited, when the test ends.
    package static var teardown: Self { Teardown() }
}
