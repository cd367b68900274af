import Mustache

/// The console's HTML escaping, used by every template and partial (each starts with
/// `{{% CONTENT_TYPE: CONSOLE_HTML }}`, and the console refuses to load one that does not).
///
/// It escapes per Unicode scalar. swift-mustache's own HTML type escapes per `Character` (an
/// extended grapheme cluster) against a table of single characters, so `"` or `>` followed by
/// a combining mark (U+0301), or `<` preceded by a Prepend character (U+0600), is a cluster
/// the table lacks and went out raw: ids and product ids could then close an attribute or
/// open a tag on an operator's page.
struct ConsoleHTML: MustacheContentType {
    /// The name the templates' pragma uses.
    static let name = "CONSOLE_HTML"
    /// The pragma every template starts with.
    static let pragma = "{{% CONTENT_TYPE: \(name) }}"

    func escapeText(_ text: String) -> String {
        Self.escape(text)
    }

    /// `text` with `&`, `<`, `>`, `"` and `'` replaced by entities, scalar by scalar.
    static func escape(_ text: String) -> String {
        var escaped = String.UnicodeScalarView()
        for scalar in text.unicodeScalars {
            switch scalar {
            case "&": escaped.append(contentsOf: "&amp;".unicodeScalars)
            case "<": escaped.append(contentsOf: "&lt;".unicodeScalars)
            case ">": escaped.append(contentsOf: "&gt;".unicodeScalars)
            case "\"": escaped.append(contentsOf: "&quot;".unicodeScalars)
            case "'": escaped.append(contentsOf: "&#39;".unicodeScalars)
            default: escaped.append(scalar)
            }
        }
        return String(escaped)
    }

    /// Registers the type with swift-mustache (idempotent), before any template is parsed.
    static func register() {
        MustacheContentTypes.register(ConsoleHTML(), named: name)
    }
}
