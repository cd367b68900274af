public import Foundation

/// What the app sells, and what each purchase grants: loaded from `IAP_CATALOG` at start.
public struct Catalog: Sendable, Equatable, Codable {
    /// Apple's product types.
    public enum ProductType: String, Sendable, Codable, CaseIterable {
        case consumable
        case nonConsumable = "non_consumable"
        case autoRenewable = "auto_renewable"
        case nonRenewing = "non_renewing"
    }

    /// One value of a grant: a number (multiplied by the quantity bought) or a name.
    public enum GrantValue: Sendable, Equatable, Codable {
        case number(Int)
        case name(String)

        public init(from decoder: any Decoder) throws {
            let container = try decoder.singleValueContainer()
            if let number = try? container.decode(Int.self) {
                self = .number(number)
            } else {
                self = .name(try container.decode(String.self))
            }
        }

        public func encode(to encoder: any Encoder) throws {
            var container = encoder.singleValueContainer()
            switch self {
            case .number(let number): try container.encode(number)
            case .name(let name): try container.encode(name)
            }
        }
    }

    /// One product.
    public struct Product: Sendable, Equatable, Codable {
        /// The App Store product identifier.
        public var productId: String
        /// Its type.
        public var type: ProductType
        /// What one unit grants, e.g. `{"coins": 60}` or `{"entitlement": "vip"}`.
        public var grant: [String: GrantValue]

        /// Creates a product.
        public init(productId: String, type: ProductType, grant: [String: GrantValue]) {
            self.productId = productId
            self.type = type
            self.grant = grant
        }

        /// What `quantity` units grant: numbers multiplied, names as they are.
        public func grant(quantity: Int) -> [String: GrantValue] {
            grant.mapValues { value in
                // Saturating: a catalog number times a bounded quantity never traps.
                if case .number(let number) = value {
                    let (product, overflow) = number.multipliedReportingOverflow(by: max(1, quantity))
                    return .number(overflow ? (number < 0 ? Int.min : Int.max) : product)
                }
                return value
            }
        }
    }

    /// Every product.
    public var products: [Product]

    /// Creates a catalog.
    public init(products: [Product]) {
        self.products = products
    }

    /// The product with this id, if the catalog has it.
    public func product(_ productId: String) -> Product? {
        products.first { $0.productId == productId }
    }

    /// Reads and checks a catalog file; the error names the file and the fault.
    public static func load(path: String) throws(CatalogError) -> Catalog {
        let data: Data
        do {
            data = try Data(contentsOf: URL(fileURLWithPath: path))
        } catch {
            throw CatalogError("\(path): cannot read the catalog (\(error.localizedDescription))")
        }
        return try parse(data, source: path)
    }

    /// Reads and checks catalog JSON; `source` names it in errors.
    public static func parse(_ data: Data, source: String) throws(CatalogError) -> Catalog {
        let catalog: Catalog
        do {
            catalog = try JSONDecoder().decode(Catalog.self, from: data)
        } catch let DecodingError.keyNotFound(key, context) {
            throw CatalogError("\(source): missing '\(key.stringValue)' at \(Self.path(context.codingPath))")
        } catch let DecodingError.typeMismatch(_, context), let DecodingError.valueNotFound(_, context) {
            throw CatalogError("\(source): wrong type at \(Self.path(context.codingPath)): \(context.debugDescription)")
        } catch let DecodingError.dataCorrupted(context) {
            throw CatalogError("\(source): \(context.debugDescription) at \(Self.path(context.codingPath))")
        } catch {
            throw CatalogError("\(source): not a catalog (\(error))")
        }
        var seen = Set<String>()
        for product in catalog.products {
            guard !product.productId.isEmpty else { throw CatalogError("\(source): a product has an empty productId") }
            guard seen.insert(product.productId).inserted else {
                throw CatalogError("\(source): product \(product.productId) is listed twice")
            }
            guard !product.grant.isEmpty else {
                throw CatalogError("\(source): product \(product.productId) grants nothing")
            }
        }
        return catalog
    }

    private static func path(_ codingPath: [any CodingKey]) -> String {
        codingPath.isEmpty
            ? "the top" : codingPath.map { $0.intValue.map { "[\($0)]" } ?? ".\($0.stringValue)" }.joined()
    }
}

/// A catalog that cannot be used; the message names the file and the fault.
public struct CatalogError: Error, Sendable, CustomStringConvertible {
    /// What is wrong, and where.
    public var description: String
    /// Creates an error.
    public init(_ description: String) { self.description = description }
}
