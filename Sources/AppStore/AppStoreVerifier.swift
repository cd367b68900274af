import Foundation
public import IAPCore

/// Verifies every upload shape the intake takes, by the best route available:
///
/// - `signedPayload` (an App Store Server Notification): the JWS and the transaction and
///   renewal info inside it, locally.
/// - `signedTransaction` (StoreKit 2): locally, with no call to Apple; then, with
///   `confirmWithAPI`, Apple's current view of it from Get Transaction Info.
/// - `receiptData`: with the Server API configured, the transaction ids are read from the
///   receipt locally and looked up (Apple's recommended way off `verifyReceipt`); else
///   `verifyReceipt`.
/// - `transactionId` alone: Get Transaction Info.
///
/// Lookups go to production first and to the sandbox when production does not know the id
/// (4040010, 4040005) or refuses the token (401, a known quirk for sandbox ids).
public final class AppStoreVerifier: ReceiptVerifying {
    private let signed: SignedDataVerifier
    private let serverAPI: AppStoreServerAPIClient?
    private let legacy: (any ReceiptVerifying)?
    private let confirmWithAPI: Bool
    private let receiptsThroughServerAPI: Bool
    private let receiptSignature: ReceiptSignature?
    private let localReceipts: Bool
    private let xcodeReceipts: ReceiptSignature?

    /// Creates a verifier. Without `serverAPI`, transaction-id uploads and confirmations are
    /// impossible (refused with a clear reason); without `legacy`, receipts need the Server API.
    public init(
        signed: SignedDataVerifier, serverAPI: AppStoreServerAPIClient?, legacy: (any ReceiptVerifying)?,
        confirmWithAPI: Bool = false, receiptsThroughServerAPI: Bool = true, receiptSignature: ReceiptSignature? = nil,
        localReceipts: Bool = false, xcodeReceipts: ReceiptSignature? = nil
    ) {
        self.xcodeReceipts = xcodeReceipts
        self.receiptSignature = receiptSignature
        self.localReceipts = localReceipts
        self.receiptsThroughServerAPI = receiptsThroughServerAPI
        self.signed = signed
        self.serverAPI = serverAPI
        self.legacy = legacy
        self.confirmWithAPI = confirmWithAPI
    }

    public func verify(_ request: VerifyRequest) async -> VerificationOutcome {
        if let payload = request.signedPayload { return await notification(payload) }
        if let jws = request.signedTransaction { return await signedTransaction(jws) }
        if !request.receiptData.isEmpty {
            // Every route checks the receipt's signature first: a provably wrong one goes no
            // further. Where the signature is the proof (offline, and the Server API route, which
            // only looks its ids up), a chain that ends in no trusted root goes to a person;
            // Apple's `verifyReceipt` vouches for a receipt itself, so it decides those.
            var signed: ReceiptSignature.Verdict?
            if let receiptSignature {
                guard let data = Data(base64Encoded: request.receiptData) else {
                    return .rejected(.invalidReceipt, message: "the receipt is not base64")
                }
                let bytes = [UInt8](data)
                let verdict = await receiptSignature.check(bytes)
                // Apple never signs a receipt of Xcode's StoreKit testing: only one Apple did
                // not sign may be one, and nobody paid for what it lists.
                if !verdict.isValid, let receipt = try? AppReceiptParser.parse(bytes), receipt.isXcode {
                    return await xcode(receipt, bytes: bytes, base64: request.receiptData)
                }
                if verdict.result == "invalid" {
                    return .rejected(.receiptSignatureInvalid, message: "the receipt's signature: \(verdict.reason ?? "invalid")")
                }
                if verdict.result != "valid", localReceipts || receiptsThroughServerAPI {
                    // Not proven either way (an untrusted chain, or signed data this reader
                    // cannot check): a person looks, never a rejection.
                    return .needsReview(.receiptUntrustedChain, message: verdict.reason ?? "no trusted root")
                }
                signed = verdict
            }
            if localReceipts { return offline(request.receiptData, signed: signed) }
            if let serverAPI, receiptsThroughServerAPI || legacy == nil {
                return await receipt(request.receiptData, serverAPI, signatureChecked: signed?.isValid == true)
            }
            if let legacy { return await legacy.verify(request) }
            return .needsReview(.notConfigured, message: "no way to verify receipts is configured")
        }
        if let transactionId = request.transactionId {
            guard let serverAPI else {
                return .needsReview(.notConfigured, message: "transaction ids need the App Store Server API key")
            }
            return await transaction(transactionId, serverAPI)
        }
        return .rejected(.invalidReceipt, message: "the upload holds nothing to verify")
    }

    // MARK: - Routes

    @inline(never)  // its own frame, allocated only on its route
    private func signedTransaction(_ jws: String) async -> VerificationOutcome {
        let payload: JWSTransactionDecodedPayload
        do {
            payload = try await signed.verifyTransaction(jws)
        } catch {
            return .rejected(ReasonCode(error.code.rawValue), message: error.message)
        }
        guard confirmWithAPI, let serverAPI else { return Self.verified([payload]) }
        let environment: ServerAPIEnvironment = payload.environment == "Sandbox" ? .sandbox : .production
        return await Self.askingApple {
            let fresh = try await serverAPI.transactionInfo(payload.transactionId, in: environment)
            return Self.verified([try await signed.verifyTransaction(fresh)])
        }
    }

    @inline(never)  // its own frame, allocated only on its route
    private func transaction(_ transactionId: String, _ serverAPI: AppStoreServerAPIClient) async -> VerificationOutcome {
        await Self.askingApple {
            let jws = try await inEitherEnvironment { try await serverAPI.transactionInfo(transactionId, in: $0) }
            // Apple answers for any transaction of the app: the id is a lookup, not a proof
            // that the uploader made the purchase.
            return Self.verified([try await signed.verifyTransaction(jws)], evidence: { _ in .lookup })
        }
    }

    /// A receipt of Xcode's StoreKit testing: refused unless `IAP_ENVIRONMENT=xcode`, where one
    /// signed by the configured Xcode certificate is read like an offline receipt, its
    /// purchases credited as sandbox ones (not real money).
    private func xcode(_ receipt: AppReceipt, bytes: [UInt8], base64: String) async -> VerificationOutcome {
        guard let xcodeReceipts else {
            return .rejected(
                .xcodeReceipt, message: "Xcode's StoreKit testing issued this receipt: refused outside \(Setting.environment.variable)=xcode")
        }
        let verdict = await xcodeReceipts.check(bytes)
        switch verdict.result {
        case "valid": return offline(base64, signed: verdict, receipt: receipt)
        case "invalid":
            return .rejected(.receiptSignatureInvalid, message: "the Xcode receipt's signature: \(verdict.reason ?? "invalid")")
        default:
            return .needsReview(
                .receiptUntrustedChain, message: "the Xcode receipt: \(verdict.reason ?? "not signed by the Xcode certificate")")
        }
    }

    /// `IAP_RECEIPTS_VIA=local`: a receipt whose signature was checked is its own proof, read
    /// with no call to Apple (which may be unreachable): every purchase it lists is the
    /// uploader's as Apple signed it, in the environment the receipt names (attribute 0:
    /// `ProductionSandbox` is the sandbox; a receipt that names none is production's).
    private func offline(_ base64: String, signed: ReceiptSignature.Verdict?, receipt read: AppReceipt? = nil) -> VerificationOutcome {
        guard signed?.isValid == true else {
            return .needsReview(.notConfigured, message: "receipts verified offline need their signature checked")
        }
        let receipt: AppReceipt
        do throws(AppReceiptError) {
            if let read { receipt = read } else { receipt = try AppReceiptParser.parse(base64: base64) }
        } catch {
            return .needsReview(.receiptUnreadable, message: "the receipt cannot be read: \(error.code)")
        }
        let environment: AppStoreEnvironment = receipt.isSandbox || receipt.isXcode ? .sandbox : .production
        guard self.signed.settings.bundleIds.contains(receipt.bundleId) else {
            return .rejected(.bundleIdMismatch, message: "the receipt belongs to \(receipt.bundleId)")
        }
        let purchases = receipt.inApp.map { item in
            var purchase = VerifiedPurchase(
                transactionId: item.transactionId, originalTransactionId: item.originalTransactionId ?? item.transactionId,
                productId: item.productId, quantity: min(max(item.quantity ?? 1, 1), VerifiedPurchase.maxQuantity), purchaseDate: item.purchaseDate,
                environment: environment, cancellationDate: item.cancellationDate, expiresDate: item.expiresDate,
                webOrderLineItemId: item.webOrderLineItemId.map(String.init))
            purchase.originalPurchaseDate = item.originalPurchaseDate
            purchase.evidence = .signedUpload
            purchase.inUploadedReceipt = true
            return purchase
        }
        return .verified(VerifiedReceipt(bundleId: receipt.bundleId, environment: environment, purchases: purchases))
    }

    /// The receipt's transactions, read locally, then the customer's whole history from one of them.
    @inline(never)  // its own frame, allocated only on its route
    private func receipt(_ base64: String, _ serverAPI: AppStoreServerAPIClient, signatureChecked: Bool) async -> VerificationOutcome {
        let receipt: AppReceipt
        do {
            receipt = try AppReceiptParser.parse(base64: base64)
        } catch {
            // Our parser, not Apple, could not read it: Apple never said it is invalid.
            return .needsReview(.receiptUnreadable, message: "the receipt cannot be read: \(error.code)")
        }
        guard signed.settings.bundleIds.contains(receipt.bundleId) else {
            return .rejected(.bundleIdMismatch, message: "the receipt belongs to \(receipt.bundleId)")
        }
        guard let anchor = receipt.inApp.max(by: { ($0.purchaseDate ?? .distantPast) < ($1.purchaseDate ?? .distantPast) })
        else {
            return .verified(VerifiedReceipt(bundleId: receipt.bundleId, environment: .production, purchases: []))
        }
        return await Self.askingApple {
            var payloads: [JWSTransactionDecodedPayload] = []
            var revision: String?
            var pages = 0
            repeat {
                let page = try await inEitherEnvironment(firstIn: payloads.first.map { $0.environment == "Sandbox" ? .sandbox : .production }) {
                    try await serverAPI.transactionHistory(anchor.transactionId, revision: revision, in: $0)
                }
                for jws in page.signedTransactions ?? [] { payloads.append(try await signed.verifyTransaction(jws)) }
                revision = page.revision
                pages += 1
                guard page.hasMore == true, pages < 500 else { break }
            } while true
            guard !payloads.isEmpty else {
                // A receipt Apple has no history for: not Apple's word that it is invalid.
                return .needsReview(
                    .appleHistoryEmpty, message: "Apple has no history for transaction \(anchor.transactionId)")
            }
            // What a receipt whose signature checked lists is the uploader's proof, as a signed
            // transaction is; without that check what it lists is looked up, and proves nobody's
            // ownership. `inUploadedReceipt` says which it held.
            let listed = Set(receipt.inApp.map(\.transactionId))
            return Self.verified(payloads, evidence: { signatureChecked && listed.contains($0.transactionId) ? .signedUpload : .lookup }) {
                listed.contains($0.transactionId)
            }
        }
    }

    @inline(never)  // its own frame, allocated only on its route
    private func notification(_ jws: String) async -> VerificationOutcome {
        do {
            let payload = try await signed.verifyNotification(jws)
            let transaction = try await payload.data?.signedTransactionInfo.asyncMap { try await signed.verifyTransaction($0) }
            let renewal = try await payload.data?.signedRenewalInfo.asyncMap { try await signed.verifyRenewalInfo($0) }
            let app = try await payload.appData?.signedAppTransactionInfo.asyncMap { try await signed.verifyAppTransaction($0) }
            var notification =
                AppStoreNotification(
                    notificationUUID: payload.notificationUUID, notificationType: payload.notificationType,
                    subtype: payload.subtype, environment: payload.environment == "Sandbox" ? .sandbox : .production,
                    bundleId: payload.bundleId, signedDate: payload.signedDate.map(Date.init(appleMilliseconds:)),
                    purchase: transaction.map(Self.purchase), subscriptionStatus: payload.data?.status,
                    autoRenewStatus: renewal?.autoRenewStatus,
                    gracePeriodExpiresDate: renewal?.gracePeriodExpiresDate.map(Date.init(appleMilliseconds:)),
                    consumptionRequestReason: payload.data?.consumptionRequestReason, appTransactionId: app?.appTransactionId,
                    renewal: renewal.map(Self.renewalTerms))
            notification.extensionSummary = payload.summary.flatMap(Self.extensionSummary)
            return .notification(notification)
        } catch let error as JWSVerificationError {
            return .rejected(ReasonCode(error.code.rawValue), message: error.message)
        } catch {
            return .rejected(.invalidReceipt, message: "\(error)")
        }
    }

    // MARK: - Helpers

    /// A mass extension's summary as the ledger keeps it: its ids cut to what fits an id
    /// (Apple's are short), its counts never negative; nil without a request identifier.
    static func extensionSummary(_ summary: ResponseBodyV2DecodedPayload.Summary) -> AppStoreNotification.ExtensionSummary? {
        guard let requestIdentifier = summary.requestIdentifier, !requestIdentifier.isEmpty else { return nil }
        return AppStoreNotification.ExtensionSummary(
            requestIdentifier: String(requestIdentifier.prefix(128)), productId: String((summary.productId ?? "").prefix(200)),
            storefrontCountryCodes: (summary.storefrontCountryCodes ?? []).prefix(300).map { String($0.prefix(3)) },
            succeededCount: max(summary.succeededCount ?? 0, 0), failedCount: max(summary.failedCount ?? 0, 0))
    }

    /// Production first; the sandbox when production does not know the id or refuses the token.
    private func inEitherEnvironment<T>(
        firstIn first: ServerAPIEnvironment? = nil, _ call: (ServerAPIEnvironment) async throws -> T
    ) async throws -> T {
        if let first { return try await call(first) }
        do {
            return try await call(.production)
        } catch let error as ServerAPIError where error.kind == .notFound || error.kind == .unauthorized {
            return try await call(.sandbox)
        }
    }

    /// Runs calls to Apple; their failures become outcomes: the Server API's by kind, a JWS
    /// in Apple's answer that does not verify as a rejection, anything else as transient.
    private static func askingApple(_ body: () async throws -> VerificationOutcome) async -> VerificationOutcome {
        do {
            return try await body()
        } catch let error as ServerAPIError {
            return outcome(of: error)
        } catch let error as JWSVerificationError {
            // Apple's own answer does not pass our checks: our roots, clock or settings, or
            // someone between us and Apple. Never the user's fault, never a rejection.
            return .needsReview(.appleAnswerUnverified, message: "Apple's answer failed our checks: \(error.code.rawValue): \(error.message)")
        } catch {
            return .retryLater(.unexpectedAppleResponse, message: "\(error)")
        }
    }

    private static func outcome(of error: ServerAPIError) -> VerificationOutcome {
        switch error.kind {
        case .transient:
            return .retryLater(error.httpStatus == 429 ? .appleRetryable : .appleUnavailable, message: error.description)
        case .notFound:
            return .rejected(.transactionNotFound, message: "Apple knows no such transaction in production or the sandbox")
        case .unauthorized:
            // Our key, not the user's purchase: a person must fix the configuration.
            return .needsReview(.serverAPIUnauthorized, message: "the App Store Server API refused our token")
        case .invalid:
            return .rejected(.invalidReceipt, message: error.description)
        }
    }

    /// What signed renewal information says the subscription renews to, bounded as a
    /// transaction's terms are (a price never below zero, Apple's short strings at most 64
    /// characters).
    static func renewalTerms(_ renewal: JWSRenewalInfoDecodedPayload) -> RenewalTerms {
        func short(_ text: String?) -> String? { text.map { String($0.prefix(64)) } }
        var terms = RenewalTerms(
            autoRenewProductId: short(renewal.autoRenewProductId),
            renewalPrice: renewal.renewalPrice.map(price), currency: short(renewal.currency),
            offerType: renewal.offerType.map { min(max($0, 0), 99) }, offerIdentifier: short(renewal.offerIdentifier),
            offerDiscountType: short(renewal.offerDiscountType), offerPeriod: short(renewal.offerPeriod),
            priceIncreaseStatus: renewal.priceIncreaseStatus.flatMap { (0...1).contains($0) ? $0 : nil })
        terms.billingPlanType = short(renewal.renewalBillingPlanType)
        if let info = renewal.commitmentInfo {
            let commitment = CommitmentRenewal(
                autoRenewProductId: short(info.commitmentAutoRenewProductId),
                autoRenewStatus: info.commitmentAutoRenewStatus.flatMap { (0...1).contains($0) ? $0 : nil },
                billingPlanType: short(info.commitmentRenewalBillingPlanType),
                renewalDate: info.commitmentRenewalDate.map(Date.init(appleMilliseconds:)),
                renewalPrice: info.commitmentRenewalPrice.map(price))
            terms.commitment = commitment == CommitmentRenewal() ? nil : commitment
        }
        return terms
    }

    /// A price Apple signed, in milli-units: never below zero, never past a trillion.
    static func price(_ value: Int64) -> Int64 { min(max(value, 0), 1_000_000_000_000) }

    /// A commitment's progress as a transaction signs it, bounded (counts 1 to 1,000).
    static func commitment(_ info: JWSTransactionDecodedPayload.CommitmentInfo?) -> CommitmentProgress? {
        guard let info else { return nil }
        let progress = CommitmentProgress(
            billingPeriodNumber: info.billingPeriodNumber.map { min(max($0, 1), 1_000) },
            totalBillingPeriods: info.totalBillingPeriods.map { min(max($0, 1), 1_000) },
            commitmentExpiresDate: info.commitmentExpiresDate.map(Date.init(appleMilliseconds:)),
            commitmentPrice: info.commitmentPrice.map(price))
        return progress == CommitmentProgress() ? nil : progress
    }

    /// A verified signed transaction as the ledger reads it (also what reconciliation applies).
    static func purchase(_ payload: JWSTransactionDecodedPayload) -> VerifiedPurchase {
        var purchase = VerifiedPurchase(
            transactionId: payload.transactionId, originalTransactionId: payload.originalTransactionId,
            productId: payload.productId, quantity: min(max(payload.quantity ?? 1, 1), VerifiedPurchase.maxQuantity),
            purchaseDate: payload.purchaseDate.map(Date.init(appleMilliseconds:)),
            environment: payload.environment == "Sandbox" ? .sandbox : .production,
            cancellationDate: payload.revocationDate.map(Date.init(appleMilliseconds:)),
            expiresDate: payload.expiresDate.map(Date.init(appleMilliseconds:)),
            appAccountToken: payload.appAccountToken?.lowercased(), webOrderLineItemId: payload.webOrderLineItemId,
            ownershipType: payload.inAppOwnershipType, isUpgraded: payload.isUpgraded,
            signedDate: payload.signedDate.map(Date.init(appleMilliseconds:)))
        purchase.revocationType = payload.revocationType
        purchase.revocationPercentage = payload.revocationPercentage.map { min(max($0, 0), 100_000) }
        purchase.transactionReason = payload.transactionReason
        purchase.originalPurchaseDate = payload.originalPurchaseDate.map(Date.init(appleMilliseconds:))
        var terms = PurchaseTerms(
            price: payload.price, currency: payload.currency, offerType: payload.offerType,
            offerIdentifier: payload.offerIdentifier, offerDiscountType: payload.offerDiscountType,
            offerPeriod: payload.offerPeriod, billingPlanType: payload.billingPlanType,
            appTransactionId: payload.appTransactionId,
            ownershipType: payload.inAppOwnershipType == "PURCHASED" ? nil : payload.inAppOwnershipType)
        terms.commitment = commitment(payload.commitmentInfo)
        purchase.terms = terms.isEmpty ? nil : terms
        purchase.previousOriginalTransactionId = payload.previousOriginalTransactionId
        return purchase
    }

    /// Apple's transactions as one verified answer; `proven`, when given, says which of them
    /// the upload itself proves (the others are history of the same account).
    private static func verified(
        _ payloads: [JWSTransactionDecodedPayload], evidence: (JWSTransactionDecodedPayload) -> OwnershipEvidence = { _ in .signedUpload },
        proven: ((JWSTransactionDecodedPayload) -> Bool)? = nil
    ) -> VerificationOutcome {
        let first = payloads[0]
        return .verified(
            VerifiedReceipt(
                bundleId: first.bundleId, environment: first.environment == "Sandbox" ? .sandbox : .production,
                purchases: payloads.map { payload in
                    var purchase = purchase(payload)
                    purchase.evidence = evidence(payload)
                    if let proven { purchase.inUploadedReceipt = proven(payload) }
                    return purchase
                }))
    }
}

extension Optional {
    fileprivate func asyncMap<U>(_ transform: (Wrapped) async throws -> U) async rethrows -> U? {
        guard let self else { return nil }
        return try await transform(self)
    }
}
