import AppStore
import ArgumentParser
import Foundation
import SwiftASN1
import X509

/// `iap inspect …`: looks inside what the pipeline handles, without changing anything.
struct InspectCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "inspect", abstract: "Look inside what the pipeline handles (read only).",
        subcommands: [InspectReceiptCommand.self, InspectJWSCommand.self])
}

/// `iap inspect receipt FILE|-`: prints what an app receipt says, as JSON.
struct InspectReceiptCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "receipt",
        abstract: "Print an app receipt's fields as JSON; with --verify, check its signature offline.",
        discussion: """
            Reads base64 text or raw DER/BER. Exits 0 with the receipt as JSON on standard output, \
            or 1 with 'error: <code>: <message>' on standard error. Without --verify the signature is not checked.
            With --verify it prints the verdict instead: the signer's chain (subjects and dates), the digest \
            algorithm, the time the chain was judged at (the receipt's creation date), the bundle id and the \
            transaction ids; it exits 0 only when the signature covers the content and the chain ends in a \
            trusted root (Apple Inc. Root and Apple Root CA - G3, shipped, unless --root names others) through \
            Apple's receipt-signing chain. With --xcode CERT, a receipt of Xcode's StoreKit testing is \
            checked against the certificate Xcode signs with instead.
            """)

    @Argument(help: "A receipt file, or - for standard input.")
    var file: String

    @Flag(name: .long, help: "Check the PKCS#7 signature and chain offline and print the verdict.")
    var verify = false

    @Option(name: .long, help: "A trusted root certificate (DER or PEM) for --verify; repeat for several.")
    var root: [String] = []

    @Option(name: .long, help: "For --verify: the certificate Xcode signs its StoreKit testing receipts with (DER or PEM).")
    var xcode: String?

    func run() async throws {
        if verify { return try await runVerify() }
        let limit = AppReceiptParser.Limits.standard.maxInputBytes
        let receipt: AppReceipt
        do {
            // Base64 text of a receipt of `limit` bytes, with room for line breaks.
            let input = try readInput(file, upTo: limit * 2 + 1)
            receipt = try Self.parse(input)
        } catch let error as AppReceiptError {
            throw fail(error.code.rawValue, error.message)
        } catch let error as InputError {
            throw fail(error.code, error.message)
        }
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        print(String(decoding: try encoder.encode(receipt), as: UTF8.self))
    }

    private func runVerify() async throws {
        let limit = AppReceiptParser.Limits.standard.maxInputBytes
        let bytes: [UInt8]
        do {
            let input = try readInput(file, upTo: limit * 2 + 1)
            bytes = try Self.der(input)
        } catch let error as AppReceiptError {
            throw fail(error.code.rawValue, error.message)
        } catch let error as InputError {
            throw fail(error.code, error.message)
        }
        let checker: ReceiptSignature
        do {
            if let xcode {
                checker = ReceiptSignature(xcodeCertificate: try certificate(atPath: xcode))
            } else {
                checker = root.isEmpty ? try ReceiptSignature() : ReceiptSignature(roots: try root.map(certificate(atPath:)))
            }
        } catch {
            throw fail("bad_root", "\(error)")
        }
        let verdict = await checker.check(bytes)
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        print(String(decoding: try encoder.encode(verdict), as: UTF8.self))
        if !verdict.isValid { throw ExitCode.failure }
    }

    /// The receipt's bytes: raw DER/BER as they are, base64 text decoded.
    static func der(_ input: [UInt8]) throws(AppReceiptError) -> [UInt8] {
        if input.count >= 2, input[0] == 0x30, input[1] >= 0x80 { return input }
        guard let text = String(validating: input, as: UTF8.self),
            let data = Data(base64Encoded: text.filter { !$0.isWhitespace })
        else {
            throw AppReceiptError(.notBase64, "the input is neither a DER/BER receipt nor base64 text")
        }
        return [UInt8](data)
    }

    /// Raw DER/BER starts with a SEQUENCE tag and a length byte that no base64 text has.
    static func parse(_ input: [UInt8]) throws(AppReceiptError) -> AppReceipt {
        if input.count >= 2, input[0] == 0x30, input[1] >= 0x80 {
            return try AppReceiptParser.parse(input)
        }
        guard let text = String(validating: input, as: UTF8.self) else {
            throw AppReceiptError(.notBase64, "the input is neither a DER/BER receipt nor base64 text")
        }
        return try AppReceiptParser.parse(base64: text)
    }

}

struct InputError: Error {
    var code: String
    var message: String
}

/// The bytes of `file` (`-`: standard input), at most `limit`.
func readInput(_ file: String, upTo limit: Int) throws -> [UInt8] {
    let handle: FileHandle
    if file == "-" {
        handle = FileHandle.standardInput
    } else {
        guard let opened = FileHandle(forReadingAtPath: file) else {
            throw InputError(code: "cannot_read", message: "cannot open \(file)")
        }
        handle = opened
    }
    defer { if file != "-" { try? handle.close() } }
    var bytes: [UInt8] = []
    do {
        while let chunk = try handle.read(upToCount: 64 * 1024), !chunk.isEmpty {
            bytes.append(contentsOf: chunk)
            guard bytes.count <= limit else {
                throw AppReceiptError(.tooLarge, "the input is longer than \(limit) bytes")
            }
        }
    } catch let error as AppReceiptError {
        throw error
    } catch {
        throw InputError(code: "cannot_read", message: "cannot read \(file): \(error.localizedDescription)")
    }
    return bytes
}

/// Reports on standard error; the caller throws the exit code.
func fail(_ code: String, _ message: String) -> ExitCode {
    FileHandle.standardError.write(Data("error: \(code): \(message)\n".utf8))
    return .failure
}

/// `iap inspect jws`: verifies a StoreKit 2 signed transaction, renewal info or App Store
/// notification and prints its payload.
struct InspectJWSCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "jws",
        abstract: "Verify a StoreKit 2 JWS (transaction, renewal info or notification) and print its payload as JSON.",
        discussion: """
            The kind is told from the payload. The chain must lead to a --root (default: Apple Root CA - G3) \
            at the payload's signedDate. A notification's signed transaction and renewal info are verified too \
            and shown decoded. Exits 0 with the payload on standard output, or 1 with \
            'error: <reason code>: <message>' on standard error.
            """)

    @Option(name: .long, help: "A trusted root certificate (DER or PEM); repeatable. Default: Apple Root CA - G3.")
    var root: [String] = []

    @Option(name: .long, help: "The bundle id the payload must name; default: whatever it names.")
    var bundleId: String?

    @Option(name: .long, help: "Production or Sandbox; default: either.")
    var environment: String?

    @Option(name: .long, help: "The app's App Store id that a production notification must name.")
    var appAppleId: Int64?

    @Argument(help: "A file holding the JWS, or - for standard input.")
    var file: String

    func run() async throws {
        let jws: String
        do {
            jws = String(decoding: try readInput(file, upTo: 1 << 20), as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        } catch let error as InputError {
            throw fail(error.code, error.message)
        }
        let parts = jws.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let payloadBytes = Base64URL.decode(parts[1].utf8),
            let payload = try? JSONSerialization.jsonObject(with: payloadBytes) as? [String: Any]
        else {
            throw fail(JWSVerificationError.Code.malformed.rawValue, "not a compact JWS with a JSON payload")
        }
        let roots: [Certificate]
        do {
            roots = root.isEmpty ? [try AppleRoot.g3()] : try root.map(certificate(atPath:))
        } catch {
            throw fail("cannot_read", "\(error)")
        }
        let named = (payload["bundleId"] as? String) ?? ((payload["data"] as? [String: Any])?["bundleId"] as? String)
        let verifier = SignedDataVerifier(
            settings: .init(
                trustedRoots: roots, bundleIds: Set([bundleId ?? named ?? ""]),
                environments: environment.map { [$0] } ?? ["Production", "Sandbox"], appAppleId: appAppleId))
        var output = payload
        do {
            if payload["notificationType"] != nil {
                let notification = try await verifier.verifyNotification(jws)
                var data = payload["data"] as? [String: Any] ?? [:]
                if let inner = notification.data?.signedTransactionInfo {
                    _ = try await verifier.verifyTransaction(inner)
                    data["decodedTransactionInfo"] = Self.payload(of: inner)
                }
                if let inner = notification.data?.signedRenewalInfo {
                    _ = try await verifier.verifyRenewalInfo(inner)
                    data["decodedRenewalInfo"] = Self.payload(of: inner)
                }
                if !data.isEmpty { output["data"] = data }
            } else if payload["transactionId"] != nil {
                _ = try await verifier.verifyTransaction(jws)
            } else {
                _ = try await verifier.verifyRenewalInfo(jws)
            }
        } catch {
            throw fail(error.code.rawValue, error.message)
        }
        let json = try JSONSerialization.data(withJSONObject: output, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes])
        print(String(decoding: json, as: UTF8.self))
    }

    private static func payload(of jws: String) -> Any? {
        let parts = jws.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let bytes = Base64URL.decode(parts[1].utf8) else { return nil }
        return try? JSONSerialization.jsonObject(with: bytes)
    }
}

/// A certificate file, PEM or DER (trusted roots for `iap inspect jws` and IAP_TRUSTED_ROOTS).
func certificate(atPath path: String) throws -> Certificate {
    let data = try Data(contentsOf: URL(fileURLWithPath: path))
    if let text = String(data: data, encoding: .utf8), text.contains("-----BEGIN CERTIFICATE-----") {
        return try Certificate(pemEncoded: text)
    }
    return try Certificate(derEncoded: [UInt8](data))
}
