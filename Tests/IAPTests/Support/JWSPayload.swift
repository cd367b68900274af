import Foundation

/// The payload of a compact JWS (`header.payload.signature`) as JSON, unverified: for tests
/// that read what the fake App Store signed. Nil for anything that is not one.
func jwsPayload(_ jws: String) -> [String: Any]? {
    let parts = jws.split(separator: ".", omittingEmptySubsequences: false)
    guard parts.count == 3 else { return nil }
    var base64 = parts[1].replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
    while base64.count % 4 != 0 { base64 += "=" }
    return Data(base64Encoded: base64).flatMap { try? JSONSerialization.jsonObject(with: $0) as? [String: Any] }
}
