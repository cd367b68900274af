import Foundation

/// What the fake App Store remembers: every purchase it minted and every receipt it issued.
actor FakeLedger {
    /// One minted purchase, as Apple would hold it.
    struct Purchase: Sendable {
        var transactionId: String
        var originalTransactionId: String
        var productId: String
        var quantity: Int
        var purchaseDate: Date
        var environment: String
        var bundleId: String
        var applicationUsername: String?
        var deviceId: String
    }

    /// A receipt snapshot: what a device's receipt held when it was issued.
    struct Receipt: Sendable {
        var bundleId: String
        var environment: String
        var transactionIds: [String]
    }

    /// An injected misbehaviour for the next `verifyReceipt` calls.
    struct Fault: Sendable, Codable {
        /// Answer with this Apple status instead of the real one.
        var status: Int?
        /// Answer with this HTTP status and an empty body.
        var httpStatus: Int?
        /// Wait this long before answering.
        var delayMs: Int?
        /// How many calls the fault applies to; 0 means until cleared.
        var count: Int?
    }

    private var purchases: [String: Purchase] = [:]
    private var purchasesByDevice: [String: [String]] = [:]
    private var receipts: [String: Receipt] = [:]
    private var faults: [Fault] = []
    private var nextTransactionNumber: UInt64
    private(set) var latencyMs = 0

    init() {
        // Apple's ids are 16-digit numbers. Starting from the clock keeps ids of a restarted
        // fake clear of the ones it minted before.
        nextTransactionNumber = 2_000_000_000_000_000 + UInt64(Date().timeIntervalSince1970 * 1000) * 1000
    }

    /// Mints a purchase and the receipt the device holds right after it.
    func mint(
        bundleId: String, productId: String, environment: String, quantity: Int, applicationUsername: String?,
        deviceId: String?
    ) -> (purchase: Purchase, receiptId: String) {
        let transactionId = String(nextTransactionNumber)
        nextTransactionNumber += 1
        let device = deviceId ?? UUID().uuidString
        let purchase = Purchase(
            transactionId: transactionId, originalTransactionId: transactionId, productId: productId,
            quantity: quantity, purchaseDate: Date(), environment: environment, bundleId: bundleId,
            applicationUsername: applicationUsername, deviceId: device)
        purchases[transactionId] = purchase
        purchasesByDevice[device, default: []].append(transactionId)
        let held = purchasesByDevice[device, default: []].filter {
            purchases[$0]?.bundleId == bundleId && purchases[$0]?.environment == environment
        }
        let receiptId = UUID().uuidString
        receipts[receiptId] = Receipt(bundleId: bundleId, environment: environment, transactionIds: held)
        return (purchase, receiptId)
    }

    func receipt(_ id: String) -> (Receipt, [Purchase])? {
        guard let receipt = receipts[id] else { return nil }
        return (receipt, receipt.transactionIds.compactMap { purchases[$0] })
    }

    func addFault(_ fault: Fault) {
        faults.append(fault)
    }

    func clearFaults() {
        faults.removeAll()
    }

    func setLatency(milliseconds: Int) {
        latencyMs = max(0, milliseconds)
    }

    /// The fault that applies to this call, if any, counting it down.
    func takeFault() -> Fault? {
        guard let fault = faults.first else { return nil }
        if let count = fault.count, count > 0 {
            if count == 1 {
                faults.removeFirst()
            } else {
                faults[0].count = count - 1
            }
        } else if fault.count == nil {
            faults.removeFirst()
        }
        return fault
    }
}
