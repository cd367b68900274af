import Foundation

/// What an id (a user id, an order id, a product id, a path's id) may hold, checked wherever
/// one enters: ids are shown to people (the console, logs) and compared by their bytes, so an
/// id may not hold what changes how the text around it is read or how it compares.
///
/// Refused: a combining mark at the start (it would join whatever precedes the id on a page),
/// format characters (Cf: bidi controls, zero-width joiners, U+0600…U+0605, BOM), control
/// characters (Cc, NUL included), line and paragraph separators, the Prepend characters of
/// Unicode's grapheme rules (they join whatever follows the id), U+FFFD (what a decoder leaves
/// of a lone surrogate) and noncharacters; and with `requireNFC`, text
/// that is not in Unicode Normalization Form C (two spellings of one name are never two users).
public enum IdentifierText {
    /// Why `text` is no acceptable id, or nil when it is.
    public static func problem(_ text: String, requireNFC: Bool = false) -> String? {
        if let first = text.unicodeScalars.first, isMark(first) {
            return "starts with a combining mark (U+\(hex(first)))"
        }
        for scalar in text.unicodeScalars {
            switch scalar.properties.generalCategory {
            case .format: return "holds a format character (U+\(hex(scalar)))"
            case .control: return "holds a control character (U+\(hex(scalar)))"
            case .lineSeparator, .paragraphSeparator: return "holds a line separator (U+\(hex(scalar)))"
            case .surrogate: return "holds a lone surrogate"
            default: break
            }
            if isPrepend(scalar) { return "holds a prepended-concatenation character (U+\(hex(scalar)))" }
            // What a decoder puts in place of a lone surrogate or broken bytes: the id is not what was sent.
            if scalar == "\u{FFFD}" || scalar.properties.isNoncharacterCodePoint {
                return "holds a replacement or noncharacter (U+\(hex(scalar)))"
            }
        }
        if requireNFC, !isNFC(text) { return "is not in Unicode Normalization Form C" }
        return nil
    }

    /// The actors the services themselves write into the audit log and the ledger: a person
    /// (an admin route's `actor`, a console sign-in's name) may not take one, or a manual
    /// revocation would read as Apple's, which only Apple's reversal undoes.
    public static let reservedActors: Set<String> = [
        "apple", "system", "reconciliation", "transfer", "intake", "verifier", "finisher", "console",
    ]

    /// Whether `name`, trimmed and in lower case, is one of `reservedActors`.
    public static func isReservedActor(_ name: String) -> Bool {
        reservedActors.contains(name.trimmingCharacters(in: .whitespacesAndNewlines).lowercased())
    }

    /// Whether `text` is its own canonical composition, compared by bytes.
    public static func isNFC(_ text: String) -> Bool {
        text.precomposedStringWithCanonicalMapping.utf8.elementsEqual(text.utf8)
    }

    static func isMark(_ scalar: Unicode.Scalar) -> Bool {
        switch scalar.properties.generalCategory {
        case .nonspacingMark, .spacingMark, .enclosingMark: true
        default: false
        }
    }

    /// Grapheme_Cluster_Break=Prepend (Unicode 15.1), the ones that are not format characters
    /// as well: each joins the character after it into one grapheme cluster.
    static func isPrepend(_ scalar: Unicode.Scalar) -> Bool {
        switch scalar.value {
        case 0x0600...0x0605, 0x06DD, 0x070F, 0x0890...0x0891, 0x08E2, 0x0D4E, 0x110BD, 0x110CD, 0x111C2...0x111C3,
            0x1193F, 0x11941, 0x11A3A, 0x11A84...0x11A89, 0x11D46, 0x11F02:
            true
        default: false
        }
    }

    private static func hex(_ scalar: Unicode.Scalar) -> String {
        let digits = String(scalar.value, radix: 16, uppercase: true)
        return String(repeating: "0", count: max(0, 4 - digits.count)) + digits
    }
}

/// Whether two user ids name the same user: equal bytes, never Swift's `==`, which holds
/// canonically equivalent spellings equal (NFD and NFC `josé`, KELVIN SIGN and `K`, OHM SIGN
/// and `Ω`) while the store, which compares bytes, holds them apart. Every ownership check
/// compares this way.
public func sameUser(_ left: String, _ right: String) -> Bool {
    left.utf8.elementsEqual(right.utf8)
}
