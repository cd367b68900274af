// swift-tools-version:6.0
import PackageDescription

// The app side of IAP Pipeline: what an iOS app adds to hand every App Store purchase to the
// order service and finish it only when the service says so. Foundation only: an app adding
// this package fetches and builds nothing of the server.
let package = Package(
    name: "iap-client",
    platforms: [.iOS(.v15), .macOS(.v12), .tvOS(.v15), .watchOS(.v8), .visionOS(.v1)],
    products: [
        .library(name: "IAPClient", targets: ["IAPClient", "IAPClientStoreKit"])
    ],
    targets: [
        // The queue, the uploader, orders and entitlements; StoreKit stands behind `PurchaseSource`.
        .target(name: "IAPClient"),
        // `PurchaseSource` over StoreKit 2. On Apple platforms it imports StoreKit; on Linux it
        // compiles against `StoreKitSurface`, the declared subset of StoreKit it uses.
        .target(
            name: "IAPClientStoreKit",
            dependencies: [
                "IAPClient",
                .target(name: "StoreKitSurface", condition: .when(platforms: [.linux])),
            ]
        ),
        // Linux only: the declarations (names and signatures as Apple documents them) of exactly
        // the StoreKit API the adapter uses, so that CI compiles the adapter. Empty elsewhere.
        .target(name: "StoreKitSurface"),
    ],
    swiftLanguageModes: [.v6]
)
