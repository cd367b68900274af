package import IAPCore

/// The products the tests sell: consumables, subscriptions, a non-consumable, a season pass.
package enum TestCatalog {
    package static let catalog = Catalog(products: [
        .init(productId: "com.example.coins.60", type: .consumable, grant: ["coins": .number(60)]),
        .init(productId: "com.example.coins.120", type: .consumable, grant: ["coins": .number(120)]),
        .init(productId: "com.example.coins.300", type: .consumable, grant: ["coins": .number(300)]),
        .init(productId: "com.example.vip.month", type: .autoRenewable, grant: ["entitlement": .name("vip")]),
        .init(productId: "com.example.vip.year", type: .autoRenewable, grant: ["entitlement": .name("vip")]),
        .init(productId: "com.example.premium", type: .nonConsumable, grant: ["entitlement": .name("premium")]),
        .init(productId: "com.example.pass.season", type: .nonRenewing, grant: ["entitlement": .name("season_pass")]),
    ])
}
