// swift-tools-version:6.2
import PackageDescription

let strictSettings: [SwiftSetting] = [
    .enableUpcomingFeature("ExistentialAny"),
    .enableUpcomingFeature("MemberImportVisibility"),
    .enableUpcomingFeature("InternalImportsByDefault"),
    .treatAllWarnings(as: .error),
]

let package = Package(
    name: "iap-pipeline",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "iap", targets: ["iap"]),
        .executable(name: "iap-microbench", targets: ["IAPMicrobench"]),
        .executable(name: "iap-app", targets: ["iap-app"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-nio", from: "2.101.3"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/async-http-client", from: "1.37.0"),
        .package(url: "https://github.com/hummingbird-project/hummingbird", from: "2.28.1"),
        .package(url: "https://github.com/apple/swift-http-types", from: "1.8.0"),
        .package(url: "https://github.com/groue/GRDB.swift", from: "7.10.0"),
        .package(url: "https://github.com/apple/swift-asn1", from: "1.7.4"),
        .package(url: "https://github.com/apple/swift-certificates", from: "1.21.1"),
        .package(url: "https://github.com/apple/swift-crypto", from: "4.5.2"),
        .package(url: "https://github.com/apple/swift-metrics", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus", from: "2.4.1"),
        .package(url: "https://github.com/vapor/jwt-kit", from: "5.8.0"),
        .package(url: "https://github.com/HdrHistogram/hdrhistogram-swift", from: "0.2.0"),
        .package(url: "https://github.com/hummingbird-project/swift-mustache", from: "2.1.1"),
        .package(url: "https://github.com/vapor/postgres-nio", from: "1.33.2"),
        // The app side, a package of its own that apps add (Foundation only).
        .package(path: "Client"),
    ],
    targets: [
        .systemLibrary(
            name: "CRabbitMQ",
            pkgConfig: "librabbitmq",
            providers: [.apt(["librabbitmq-dev"])]
        ),
        .systemLibrary(
            name: "CZlib",
            pkgConfig: "zlib",
            providers: [.apt(["zlib1g-dev"])]
        ),
        .target(
            name: "IAPCore",
            swiftSettings: strictSettings
        ),
        .target(
            name: "Messaging",
            dependencies: [
                "CRabbitMQ",
                "CZlib",
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "AppStore",
            dependencies: [
                "IAPCore",
                .product(name: "SwiftASN1", package: "swift-asn1"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOFoundationCompat", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "JWTKit", package: "jwt-kit"),
            ],
            resources: [.copy("Resources/AppleRootCA-G3.der"), .copy("Resources/AppleIncRootCertificate.der")],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Ledger",
            dependencies: ["IAPCore"],
            // Optimized in debug builds too: the model checker (LedgerTests) runs the planner on
            // 100,000 sequences a run; with this and LedgerTestSupport optimized it takes 29 s
            // here, not 89 s.
            swiftSettings: strictSettings + [.unsafeFlags(["-O"])]
        ),
        // The storage engine: SQL over SQLite (GRDB) and PostgreSQL (postgres-nio) behind one
        // connection type, transactions by purpose, group commit, the schema's history. Nothing
        // of it is public: `OrderStore` is its only user.
        .target(
            name: "Store",
            dependencies: [
                "IAPCore",
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "GRDBSQLite", package: "GRDB.swift"),
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            swiftSettings: strictSettings
        ),
        // The ledger's shell and the read models, on the engine.
        .target(
            name: "OrderStore",
            dependencies: [
                "IAPCore", "Ledger", "Store",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "FakeAppStore",
            dependencies: [
                "IAPCore",
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOFoundationCompat", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Relay",
            dependencies: [
                "IAPCore", "OrderStore", "Messaging",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Intake",
            dependencies: [
                .product(name: "Metrics", package: "swift-metrics"),
                "IAPCore", "Ledger", "OrderStore", "AppStore",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdCore", package: "hummingbird"),
                .product(name: "HTTPTypes", package: "swift-http-types"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Verifier",
            dependencies: [
                .product(name: "Metrics", package: "swift-metrics"),
                "IAPCore", "Messaging", "AppStore",
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        // The calls to Apple the order service makes on its own: finishing settled transactions,
        // answering consumption requests, reconciling with Apple's history. Each drains a queue
        // of the store, woken by the store's signal for it.
        .target(
            name: "AppleCalls",
            dependencies: [
                "IAPCore", "AppStore", "Ledger", "OrderStore",
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Finisher",
            dependencies: [
                "IAPCore", "Messaging", "OrderStore",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Console",
            dependencies: [
                "IAPCore", "Ledger", "OrderStore", "AppStore", "Messaging",
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HTTPTypes", package: "swift-http-types"),
                .product(name: "Mustache", package: "swift-mustache"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            resources: [.copy("Templates"), .copy("Static")],
            swiftSettings: strictSettings
        ),
        .target(
            name: "Pipeline",
            dependencies: [
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Hummingbird", package: "hummingbird"),
                "IAPCore", "Messaging", "AppStore", "Ledger", "OrderStore",
                "Intake", "Relay", "Verifier", "Finisher", "AppleCalls", "Console",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
            ],
            swiftSettings: strictSettings
        ),
        .executableTarget(
            name: "iap",
            dependencies: [
                "IAPCore", "Messaging", "AppStore", "Ledger", "OrderStore", "FakeAppStore",
                "Intake", "Relay", "Verifier", "Finisher", "AppleCalls", "Pipeline", "Console",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOFoundationCompat", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Histogram", package: "hdrhistogram-swift"),
            ],
            swiftSettings: strictSettings
        ),
        .executableTarget(
            name: "IAPMicrobench",
            dependencies: [
                "IAPCore", "AppStore", "FakeAppStore", "OrderStore", "Store", "Messaging",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            swiftSettings: strictSettings
        ),
        // The simulated app: devices buying through `IAPClient` from the fake App Store.
        .target(
            name: "AppSimulator",
            dependencies: [
                .product(name: "IAPClient", package: "Client"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ],
            swiftSettings: strictSettings
        ),
        .executableTarget(
            name: "iap-app",
            dependencies: [
                "AppSimulator",
                .product(name: "IAPClient", package: "Client"),
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ],
            swiftSettings: strictSettings
        ),
        // The ledger core's checker and what it runs on: the tables in memory (`MemoryLedger`),
        // the reference model, the seeded generator. Optimized even in debug builds: its
        // 100,000 random sequences a run are the suite's largest piece of pure computation.
        .target(
            name: "LedgerTestSupport",
            dependencies: ["IAPCore", "Ledger"],
            path: "Tests/LedgerTestSupport",
            swiftSettings: strictSettings + [.unsafeFlags(["-O"])]
        ),
        // What the store's tests and the others share: a store on either backend (`TestStore`),
        // the teardown trait, a publisher that stands in for the broker.
        .target(
            name: "TestSupport",
            dependencies: [
                "IAPCore", "Store", "OrderStore", "Messaging",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            path: "Tests/TestSupport",
            swiftSettings: strictSettings
        ),
        // The store alone: the engine and the ledger's shell on SQLite and on PostgreSQL, no broker.
        .testTarget(
            name: "StoreTests",
            dependencies: [
                "IAPCore", "Ledger", "LedgerTestSupport", "Store", "OrderStore", "Relay", "Messaging", "Intake",
                "FakeAppStore", "TestSupport",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
            ],
            swiftSettings: strictSettings
        ),
        // The ledger's rules and its model checker: no store, no broker, no server.
        .testTarget(
            name: "LedgerTests",
            dependencies: ["IAPCore", "Ledger", "LedgerTestSupport"],
            exclude: ["Fixtures"],
            swiftSettings: strictSettings
        ),
        // The edge alone: every route through the intake's router in process
        // (`app.test(.router)`), over an SQLite store: no broker, no PostgreSQL, no socket.
        .testTarget(
            name: "EdgeTests",
            dependencies: [
                "IAPCore", "Intake", "OrderStore",
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdTesting", package: "hummingbird"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "NIOCore", package: "swift-nio"),
            ],
            swiftSettings: strictSettings
        ),
        .testTarget(
            name: "IAPTests",
            dependencies: [
                "IAPCore", "Ledger", "LedgerTestSupport", "TestSupport", "Messaging", "AppStore", "Store", "OrderStore", "FakeAppStore",
                "Intake", "Relay", "Verifier", "Finisher", "AppleCalls", "Pipeline", "Console", "AppSimulator",
                .product(name: "IAPClient", package: "Client"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOFoundationCompat", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            // Read from their paths by the tests that use them (`#filePath`), not bundled.
            exclude: ["Fixtures"],
            swiftSettings: strictSettings
        ),
    ]
)
