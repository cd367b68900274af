import Foundation
import SwiftASN1

extension ReceiptPayload {
    /// The payload as Apple encodes it: a DER SET of `ReceiptAttribute`s.
    public func derEncoded() throws -> [UInt8] {
        var attributes = [
            try ReceiptAttribute(type: 0, value: ASN1UTF8String(receiptType)),
            try ReceiptAttribute(type: 2, value: ASN1UTF8String(bundleId)),
            try ReceiptAttribute(type: 3, value: ASN1UTF8String(appVersion)),
            ReceiptAttribute(type: 4, rawValue: opaqueValue),
            ReceiptAttribute(type: 5, rawValue: sha1Hash),
            try ReceiptAttribute(type: 12, value: ReceiptAttribute.date(creationDate)),
            try ReceiptAttribute(type: 19, value: ASN1UTF8String(originalAppVersion)),
        ]
        for purchase in inApp {
            attributes.append(ReceiptAttribute(type: 17, rawValue: try purchase.derEncoded()))
        }
        var serializer = DER.Serializer()
        try serializer.serializeSetOf(attributes)
        return serializer.serializedBytes
    }
}

extension InAppPurchasePayload {
    /// The purchase as Apple encodes it inside attribute 17: a DER SET of `ReceiptAttribute`s.
    func derEncoded() throws -> [UInt8] {
        var attributes = [
            try ReceiptAttribute(type: 1701, value: quantity),
            try ReceiptAttribute(type: 1702, value: ASN1UTF8String(productId)),
            try ReceiptAttribute(type: 1703, value: ASN1UTF8String(transactionId)),
            try ReceiptAttribute(type: 1704, value: ReceiptAttribute.date(purchaseDate)),
            try ReceiptAttribute(type: 1705, value: ASN1UTF8String(originalTransactionId)),
            try ReceiptAttribute(type: 1706, value: ReceiptAttribute.date(originalPurchaseDate)),
        ]
        if let expiresDate {
            attributes.append(try ReceiptAttribute(type: 1708, value: ReceiptAttribute.date(expiresDate)))
        }
        if let webOrderLineItemId {
            attributes.append(try ReceiptAttribute(type: 1711, value: webOrderLineItemId))
        }
        if let cancellationDate {
            attributes.append(try ReceiptAttribute(type: 1712, value: ReceiptAttribute.date(cancellationDate)))
        }
        var serializer = DER.Serializer()
        try serializer.serializeSetOf(attributes)
        return serializer.serializedBytes
    }
}

/// `ReceiptAttribute ::= SEQUENCE { type INTEGER, version INTEGER, value OCTET STRING }`, where
/// `value` holds the DER of the field's own value.
struct ReceiptAttribute: DERImplicitlyTaggable {
    static var defaultIdentifier: ASN1Identifier { .sequence }

    /// The field's type number (2 bundle id, 17 in-app purchase, 1703 transaction id, …).
    var type: Int
    /// Apple's attribute version; 1 throughout.
    var version: Int
    /// The DER of the field's value (or raw bytes for the opaque value and hash).
    var value: ASN1OctetString

    /// An attribute whose value is raw bytes (opaque value, hash, a nested SET).
    init(type: Int, version: Int = 1, rawValue: [UInt8]) {
        self.type = type
        self.version = version
        self.value = ASN1OctetString(contentBytes: rawValue[...])
    }

    /// An attribute whose value is the DER of `value`.
    init(type: Int, version: Int = 1, value: some DERSerializable) throws {
        var serializer = DER.Serializer()
        try serializer.serialize(value)
        self.init(type: type, version: version, rawValue: serializer.serializedBytes)
    }

    init(derEncoded node: ASN1Node, withIdentifier identifier: ASN1Identifier) throws {
        self = try DER.sequence(node, identifier: identifier) { nodes in
            let type = try Int(derEncoded: &nodes)
            let version = try Int(derEncoded: &nodes)
            let value = try ASN1OctetString(derEncoded: &nodes)
            return ReceiptAttribute(type: type, version: version, rawValue: Array(value.bytes))
        }
    }

    func serialize(into coder: inout DER.Serializer, withIdentifier identifier: ASN1Identifier) throws {
        try coder.appendConstructedNode(identifier: identifier) { coder in
            try coder.serialize(type)
            try coder.serialize(version)
            try coder.serialize(value)
        }
    }

    /// An RFC 3339 date in whole seconds, as the IA5String Apple uses.
    static func date(_ date: Date) throws -> ASN1IA5String {
        try ASN1IA5String(date.formatted(.iso8601))
    }
}
