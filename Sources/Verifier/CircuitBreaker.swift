import Foundation
import NIOConcurrencyHelpers
public import IAPCore

/// Stops calling Apple for a while after a burst of transient failures, so an outage does not
/// burn every upload's retries; then lets one probe through and closes again when it succeeds.
///
/// Closed: every call goes through; `failureThreshold` transient failures in a row open it.
/// Open: no call goes through for `openDuration`. Half-open: one probe at a time; a success
/// closes the breaker, a failure opens it again.
public final class CircuitBreaker: Sendable {
    /// How the breaker reacts.
    public struct Settings: Sendable, Equatable {
        /// Transient failures in a row that open the breaker.
        public var failureThreshold: Int
        /// How long it stays open before a probe.
        public var openDuration: Duration

        /// Creates settings.
        public init(
            failureThreshold: Int = Setting.breakerFailures.defaultInt, openDuration: Duration = Setting.breakerOpenSeconds.defaultSeconds
        ) {
            self.failureThreshold = max(1, failureThreshold)
            self.openDuration = openDuration
        }
    }

    /// What a caller may do now.
    public enum Permit: Sendable, Equatable {
        /// Call Apple.
        case call
        /// Call Apple as the one probe of a half-open breaker.
        case probe
        /// Do not call; put the work back for later.
        case wait
    }

    private enum State {
        case closed(failures: Int)
        case open(until: ContinuousClock.Instant)
        case halfOpen(probing: Bool)
    }

    private let settings: Settings
    private let state = NIOLockedValueBox(State.closed(failures: 0))

    /// Creates a closed breaker.
    public init(settings: Settings) {
        self.settings = settings
    }

    /// Whether a call may go to Apple now.
    public func permit(now: ContinuousClock.Instant = .now) -> Permit {
        state.withLockedValue { state in
            switch state {
            case .closed:
                return .call
            case .open(let until):
                guard now >= until else { return .wait }
                state = .halfOpen(probing: true)
                return .probe
            case .halfOpen(let probing):
                if probing { return .wait }
                state = .halfOpen(probing: true)
                return .probe
            }
        }
    }

    /// Records a call's result: `transientFailure` for anything that asks to retry later.
    /// Returns true when this record opened the breaker.
    @discardableResult
    public func record(transientFailure: Bool, now: ContinuousClock.Instant = .now) -> Bool {
        state.withLockedValue { state in
            switch (state, transientFailure) {
            case (.closed(let failures), true):
                if failures + 1 >= settings.failureThreshold {
                    state = .open(until: now + settings.openDuration)
                    return true
                }
                state = .closed(failures: failures + 1)
            case (.closed, false):
                state = .closed(failures: 0)
            case (.halfOpen, true):
                state = .open(until: now + settings.openDuration)
                return true
            case (.halfOpen, false):
                state = .closed(failures: 0)
            case (.open, _):
                // A call that started before the breaker opened; the open period stands.
                break
            }
            return false
        }
    }

    /// Whether the breaker currently holds calls back.
    public var isOpen: Bool {
        state.withLockedValue { state in
            if case .closed = state { return false }
            return true
        }
    }
}
