import AppStore
import ArgumentParser
import Foundation

/// `iap inspect …`: looks inside what the pipeline handles, without changing anything.
struct InspectCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "inspect", abstract: "Look inside what the pipeline handles (read only).",
        subcommands: [InspectReceiptCommand.self])
}

/// `iap inspect receipt FILE|-`: prints what an app receipt says, as JSON.
struct InspectReceiptCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "receipt",
        abstract: "Print an app receipt's fields as JSON. The signature is not checked.",
        discussion: """
            Reads base64 text or raw DER/BER. Exits 0 with the receipt as JSON on standard output, \
            or 1 with 'error: <code>: <message>' on standard error.
            """)

    @Argument(help: "A receipt file, or - for standard input.")
    var file: String

    func run() async throws {
        let limit = AppReceiptParser.Limits.standard.maxInputBytes
        let receipt: AppReceipt
        do {
            // Base64 text of a receipt of `limit` bytes, with room for line breaks.
            let input = try readInput(upTo: limit * 2 + 1)
            receipt = try Self.parse(input)
        } catch let error as AppReceiptError {
            throw Self.fail(error.code.rawValue, error.message)
        } catch let error as InputError {
            throw Self.fail(error.code, error.message)
        }
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        print(String(decoding: try encoder.encode(receipt), as: UTF8.self))
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

    private struct InputError: Error {
        var code: String
        var message: String
    }

    private func readInput(upTo limit: Int) throws -> [UInt8] {
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
    private static func fail(_ code: String, _ message: String) -> ExitCode {
        FileHandle.standardError.write(Data("error: \(code): \(message)\n".utf8))
        return .failure
    }
}
