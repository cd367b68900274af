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

    /// Apple's own names besides `apple`: a person signing as one would read as Apple too.
    public static let applesNames: Set<String> = [
        "apple inc", "apple computer", "apple computer inc", "app store", "apple app store", "itunes", "itunes store",
        "applecare", "apple support", "storekit",
    ]

    /// The skeletons of `reservedActors` and `applesNames`.
    private static let reservedSkeletons = Set((reservedActors.union(applesNames)).map(skeleton))

    /// Whether `name` looks like one of `reservedActors` or Apple's names: compared by their
    /// confusable skeletons (`skeleton`), so `Apple Inc.`, full-width `ａｐｐｌｅ` and `apple` with a
    /// Cyrillic `а` are all Apple.
    public static func isReservedActor(_ name: String) -> Bool {
        reservedSkeletons.contains(skeleton(name))
    }

    /// Why `name` may not sign the audit log, or nil when it may: it looks like a service's or
    /// Apple's name, or its letters come from more than one script (Latin with Cyrillic or Greek
    /// letters is how a lookalike is spelled).
    public static func actorProblem(_ name: String) -> String? {
        // What an app user does is signed `user:<id>`: no person's name may look like that.
        if skeleton(name).hasPrefix(skeleton("user")) && name.contains(":") {
            return "starts like an app user's entry (user:…), which staff names never do"
        }
        if isReservedActor(name) {
            return "looks like one of the services' or Apple's names (\(reservedActors.sorted().joined(separator: ", ")), Apple Inc., …)"
        }
        let scripts = scripts(of: name)
        if scripts.count > 1 { return "mixes letters of several scripts (\(scripts.sorted().joined(separator: ", ")))" }
        return nil
    }

    /// A confusable skeleton after Unicode's UTS #39, whatever the script, and blind to case:
    /// two names with one skeleton look alike. The compatibility form (full-width `ａ` is `a`);
    /// then, until nothing changes, the canonical decomposition, each character replaced by its
    /// prototype (`lookalikes`, else `ConfusableTable`: Unicode's confusables.txt, where Cyrillic
    /// `а` and Cherokee `Ꭺ` are `a`, `1` and `I` are `l`, `0` is `O`, `m` is `rn`, and the letters
    /// it leaves out, `ⱥ` and small capital `ᴀ`), and lower case; last, marks, spaces,
    /// punctuation and symbols dropped.
    public static func skeleton(_ text: String) -> String {
        var folded = text.precomposedStringWithCompatibilityMapping
        // A prototype may be upper case, and its lower case have a prototype of its own
        // (`Ꭺ`, `A`, `a`; `M`, `m`, `rn`): three rounds reach the end for every character.
        for _ in 0..<8 {
            var mapped = String.UnicodeScalarView()
            for scalar in folded.decomposedStringWithCanonicalMapping.unicodeScalars {
                let value = scalar.value
                if let prototype = lookalikes[scalar] ?? ConfusableTable.prototypes[value] ?? ConfusableTable.letterBases[value] {
                    mapped.append(contentsOf: prototype.unicodeScalars)
                } else {
                    mapped.append(scalar)
                }
            }
            let next = String(mapped).decomposedStringWithCanonicalMapping.lowercased()
            if next.unicodeScalars.elementsEqual(folded.unicodeScalars) { break }
            folded = next
        }
        var skeleton = String.UnicodeScalarView()
        for scalar in folded.decomposedStringWithCanonicalMapping.unicodeScalars {
            switch scalar.properties.generalCategory {
            case .uppercaseLetter, .lowercaseLetter, .titlecaseLetter, .modifierLetter, .otherLetter, .decimalNumber,
                .letterNumber, .otherNumber:
                skeleton.append(scalar)
            default:
                continue
            }
        }
        return String(skeleton)
    }

    /// The project's own prototypes, looked up before confusables.txt's: lower-case `i` is `l`,
    /// as `I` is there (its prototypes keep case); `ʍ` and `ĸ`, what it makes of small capitals
    /// `ᴍ` and `ᴋ` and of Cyrillic `м` and `к`, are `m` and `k`, as other small capitals are
    /// their letters; Greek `ε`, `β` and `χ` are `e`, `b` and `x`, as they were here before
    /// (there: `ꞓ`, `ß` and itself).
    private static let lookalikes: [Unicode.Scalar: String] = [
        "i": "l", "\u{028D}": "m", "\u{0138}": "k", "\u{03B5}": "e", "\u{03B2}": "b", "\u{03C7}": "x",
    ]

    /// The scripts of the letters of `text` (after its compatibility form), from a small table of
    /// blocks; Han, Hiragana, Katakana and Hangul count as one (they are written together).
    public static func scripts(of text: String) -> Set<String> {
        var scripts = Set<String>()
        for scalar in text.precomposedStringWithCompatibilityMapping.unicodeScalars where scalar.properties.isAlphabetic {
            if isMark(scalar) { continue }
            scripts.insert(script(of: scalar.value))
        }
        return scripts
    }

    private static func script(of value: UInt32) -> String {
        switch value {
        case 0x41...0x5A, 0x61...0x7A, 0xAA, 0xBA, 0xC0...0x24F, 0x250...0x2AF, 0x1D00...0x1D7F, 0x1E00...0x1EFF,
            0x2C60...0x2C7F, 0xA720...0xA7FF, 0xAB30...0xAB6F:
            "Latin"
        case 0x370...0x3FF, 0x1F00...0x1FFF: "Greek"
        case 0x400...0x52F, 0x1C80...0x1C8F, 0x2DE0...0x2DFF, 0xA640...0xA69F: "Cyrillic"
        case 0x530...0x58F: "Armenian"
        case 0x590...0x5FF: "Hebrew"
        case 0x600...0x6FF, 0x750...0x77F, 0x8A0...0x8FF: "Arabic"
        case 0x900...0x97F: "Devanagari"
        case 0xE00...0xE7F: "Thai"
        case 0x10A0...0x10FF: "Georgian"
        case 0x13A0...0x13FF, 0xAB70...0xABBF: "Cherokee"
        case 0x1100...0x11FF, 0x3040...0x30FF, 0x3130...0x318F, 0x31F0...0x31FF, 0x3400...0x4DBF, 0x4E00...0x9FFF,
            0xAC00...0xD7AF, 0xF900...0xFAFF, 0x20000...0x3FFFF:
            "Han, Kana and Hangul"
        default: "another script (U+\(String(value >> 8, radix: 16, uppercase: true))xx)"
        }
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
