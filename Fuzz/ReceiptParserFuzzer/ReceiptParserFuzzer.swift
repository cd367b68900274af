// libFuzzer entry point for the local receipt parser. scripts/fuzz-receipt-parser compiles it
// together with the parser's sources (Sources/AppStore/AppReceipt*.swift, BERReader.swift),
// which need nothing but Foundation, so no package build is involved.

/// Feeds one input to the parser, as raw bytes and, when it is text, as base64.
@_cdecl("LLVMFuzzerTestOneInput")
public func receiptParserFuzzInput(_ data: UnsafePointer<UInt8>?, _ size: Int) -> CInt {
    let bytes = data.map { Array(UnsafeBufferPointer(start: $0, count: size)) } ?? []
    check(try? AppReceiptParser.parse(bytes))
    if let text = String(validating: bytes, as: UTF8.self) {
        check(try? AppReceiptParser.parse(base64: text))
    }
    return 0
}

/// What every successful parse promises.
private func check(_ receipt: AppReceipt?) {
    guard let receipt else { return }
    precondition(!receipt.bundleId.isEmpty, "a parsed receipt has an empty bundle id")
    for purchase in receipt.inApp {
        precondition(!purchase.transactionId.isEmpty, "a parsed purchase has an empty transaction id")
        precondition(!purchase.productId.isEmpty, "a parsed purchase has an empty product id")
        precondition((purchase.quantity ?? 0) >= 0, "a parsed purchase has a negative quantity")
    }
}
