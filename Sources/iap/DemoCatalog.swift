/// The demo catalog `iap dev` uses when IAP_CATALOG is unset; the same as `compose/catalog.json`.
enum DemoCatalog {
    static let json = #"""
{
  "products": [
    {"productId": "com.example.coins.60", "type": "consumable", "grant": {"coins": 60}},
    {"productId": "com.example.coins.120", "type": "consumable", "grant": {"coins": 120}},
    {"productId": "com.example.coins.300", "type": "consumable", "grant": {"coins": 300}},
    {"productId": "com.example.remove_ads", "type": "non_consumable", "grant": {"entitlement": "no_ads"}},
    {"productId": "com.example.vip.month", "type": "auto_renewable", "grant": {"entitlement": "vip"}},
    {"productId": "com.example.vip.year", "type": "auto_renewable", "grant": {"entitlement": "vip"}},
    {"productId": "com.example.pass.season", "type": "non_renewing", "grant": {"entitlement": "season_pass"}}
  ]
}
"""#
}
