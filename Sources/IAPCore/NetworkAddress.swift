import Foundation

/// An IPv4 or IPv6 address, parsed from its text (never compared as a string): what the
/// intake calls a client's address, and what loopback and trusted-proxy checks are made on.
public struct NetworkAddress: Hashable, Sendable, CustomStringConvertible {
    /// The address's bytes in network order: 4 for IPv4, 16 for IPv6.
    public let bytes: [UInt8]

    /// Parses `text`: dotted IPv4 (`127.0.0.1`), or IPv6 with or without brackets (`::1`,
    /// `[::1]`); an IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) is its IPv4 address. Nil for
    /// anything else, host names included.
    public init?(_ text: some StringProtocol) {
        var text = String(text)
        if text.hasPrefix("["), text.hasSuffix("]") { text = String(text.dropFirst().dropLast()) }
        guard !text.isEmpty, text.utf8.count <= 45 else { return nil }
        var v4 = in_addr()
        if inet_pton(AF_INET, text, &v4) == 1 {
            bytes = withUnsafeBytes(of: v4) { Array($0) }
            return
        }
        var v6 = in6_addr()
        guard inet_pton(AF_INET6, text, &v6) == 1 else { return nil }
        let raw = withUnsafeBytes(of: v6) { Array($0) }
        bytes = raw[0..<10].allSatisfy { $0 == 0 } && raw[10] == 0xFF && raw[11] == 0xFF ? Array(raw[12..<16]) : raw
    }

    /// Whether only this machine reaches the address: 127.0.0.0/8 or ::1.
    public var isLoopback: Bool {
        bytes.count == 4 ? bytes[0] == 127 : bytes == [UInt8](repeating: 0, count: 15) + [1]
    }

    /// The canonical text (`inet_ntop`): one spelling per address.
    public var description: String {
        var buffer = [CChar](repeating: 0, count: Int(INET6_ADDRSTRLEN))
        let family = bytes.count == 4 ? AF_INET : AF_INET6
        let written = bytes.withUnsafeBytes { source in
            inet_ntop(family, source.baseAddress, &buffer, socklen_t(buffer.count))
        }
        guard written != nil else { return bytes.map(String.init).joined(separator: ".") }
        return String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// Whether a listener's host setting is a loopback address (or `localhost`): only this
    /// machine reaches it. Decided on the parsed address, never on a prefix of the text
    /// (`127.evil.example.com` is a host name, not loopback).
    public static func isLoopbackHost(_ host: String) -> Bool {
        host.lowercased() == "localhost" || NetworkAddress(host)?.isLoopback == true
    }
}

/// A block of addresses in CIDR notation (`10.0.0.0/8`, `fd00::/8`, or one address).
public struct NetworkBlock: Hashable, Sendable, CustomStringConvertible {
    /// The block's first address (host bits cleared).
    public let base: NetworkAddress
    /// How many leading bits every address of the block shares with `base`.
    public let prefixLength: Int

    /// Parses `10.0.0.0/8`, `::1/128` or a lone address (all its bits); nil for anything else.
    public init?(_ text: some StringProtocol) {
        let parts = text.split(separator: "/", maxSplits: 1, omittingEmptySubsequences: false)
        guard let address = NetworkAddress(parts[0]) else { return nil }
        let width = address.bytes.count * 8
        if parts.count == 2 {
            guard let length = Int(parts[1]), (0...width).contains(length) else { return nil }
            prefixLength = length
        } else {
            prefixLength = width
        }
        base = address
    }

    /// Whether `address` lies in the block (an IPv4 address never lies in an IPv6 block).
    public func contains(_ address: NetworkAddress) -> Bool {
        guard address.bytes.count == base.bytes.count else { return false }
        var remaining = prefixLength
        for (mine, theirs) in zip(base.bytes, address.bytes) where remaining > 0 {
            let bits = min(8, remaining)
            let mask = UInt8(truncatingIfNeeded: 0xFF << (8 - bits))
            guard mine & mask == theirs & mask else { return false }
            remaining -= bits
        }
        return true
    }

    public var description: String { "\(base)/\(prefixLength)" }
}

/// Where a request's client address comes from: the TCP peer, unless the peer is one of the
/// reverse proxies the operator names (`IAP_TRUSTED_PROXIES`), in which case the last value of
/// the proxy's header (`IAP_CLIENT_IP_HEADER`) that parses as an address. A header from any other
/// peer is ignored: a client can never pick its own address, nor name the operator's.
public struct ClientAddressPolicy: Sendable, Equatable {
    /// The header the trusted proxies set (e.g. `X-Real-IP`), lowercased; nil: the peer always.
    public let header: String?
    /// The proxies whose header is believed.
    public let trustedProxies: [NetworkBlock]

    /// The TCP peer, always.
    public static let peer = ClientAddressPolicy(header: nil, trustedProxies: [])

    /// A policy believing `header` from `trustedProxies` only.
    public init(header: String?, trustedProxies: [NetworkBlock]) {
        self.header = header?.lowercased()
        self.trustedProxies = trustedProxies
    }

    /// The client's address for a request from `peer` (its text; nil when unknown) whose
    /// `header` values are `headerValue` (nil when absent). Always an address's canonical text,
    /// or `unknown`: never text the client chose.
    public func clientAddress(peer: String?, headerValue: String?) -> String {
        let peerAddress = peer.flatMap { NetworkAddress($0) }
        guard let peerAddress else { return peer == nil ? "unknown" : "unparsable-peer" }
        guard header != nil, trustedProxies.contains(where: { $0.contains(peerAddress) }),
            let last = headerValue?.split(separator: ",").last,
            let named = NetworkAddress(last.trimmingCharacters(in: .whitespaces))
        else { return peerAddress.description }
        return named.description
    }
}
