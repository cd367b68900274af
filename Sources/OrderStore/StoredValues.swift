package import IAPCore
package import Ledger
package import Store

// The one place where the core's vocabulary becomes the text of a column and is read back.

/// A credit key is kept in its stored form (`txn:`, `otx:` or `wol:` and the id): the one place
/// where it becomes text and is read back.
extension CreditKey: SQLValueConvertible {
    package var sqlValue: SQLValue { .text(stored) }
    package static func fromSQL(_ value: SQLValue) -> CreditKey? { String.fromSQL(value).flatMap(CreditKey.init(stored:)) }
}

/// A reason is kept as its word (`owner_unknown`, `revoked`, …), as the error catalogue names it.
extension ReasonCode: SQLValueConvertible {
    package var sqlValue: SQLValue { .text(rawValue) }
    package static func fromSQL(_ value: SQLValue) -> ReasonCode? { String.fromSQL(value).map(ReasonCode.init(rawValue:)) }
}

/// The ledger's states and sources are kept as their raw values.
extension GrantState: SQLValueConvertible {}
extension GrantSource: SQLValueConvertible {}
extension GrantRevoker: SQLValueConvertible {}
extension OrderState: SQLValueConvertible {}
extension SubscriptionState: SQLValueConvertible {}
