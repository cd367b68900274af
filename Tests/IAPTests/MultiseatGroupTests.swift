import FakeAppStore
import Foundation
import NIOHTTP1
import Testing
import TestSupport

extension BrokerTests {
    /// Multiseat subscriptions (App Store Server API 1.22): customer service sees the groups a
    /// user's Apple customers are in (Get Customer Groups) and a group's members (Get Group
    /// Members), each member with the users it is known for here, through the real pipeline.
    @Suite("Multiseat: groups and members for customer service")
    struct MultiseatGroupTests {
        struct Mint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId = "com.example.vip.month"
            var type = "auto_renewable"
            var environment = "Sandbox"
            var inAppOwnershipType: String
            var quantity: Int
            var deviceId: String
            var groupId: String?
        }

        /// Mints on a device of its own, uploads the signed transaction as `userId`; the
        /// transaction id.
        static func buy(_ mint: Mint, as userId: String, in pipeline: PipelineHarness) async throws -> String {
            let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: mint)
            #expect(minted.status == 201, "\(minted.text)")
            let signed = try #require(minted.json["signedTransaction"] as? String)
            let id = try await pipeline.upload(["userId": userId, "signedTransaction": signed])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            return try #require(minted.json["transactionId"] as? String)
        }

        static func members(_ answer: HTTP.Answer) -> [(id: String, users: [String])] {
            (answer.json["members"] as? [[String: Any]] ?? []).map {
                ($0["appTransactionId"] as? String ?? "", $0["userIds"] as? [String] ?? [])
            }
        }

        @Test(arguments: TestStore.backends)
        func customerServiceSeesAUsersGroupsAndAGroupsMembers(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "groups", on: backend)
            Teardown.add { await pipeline.stop() }
            let group = "8\(Int.random(in: 10_000_000...99_999_999))000000000"
            // The organization's admin buys three seats; it assigns two, to ana and ben.
            _ = try await Self.buy(
                Mint(inAppOwnershipType: "PURCHASED", quantity: 3, deviceId: "olga-\(group)", groupId: group), as: "olga", in: pipeline)
            _ = try await Self.buy(
                Mint(inAppOwnershipType: "ASSIGNED", quantity: 3, deviceId: "ana-\(group)", groupId: group), as: "ana", in: pipeline)
            let bens = try await Self.buy(
                Mint(inAppOwnershipType: "ASSIGNED", quantity: 3, deviceId: "ben-\(group)", groupId: group), as: "ben", in: pipeline)

            let anas = try await pipeline.admin(.GET, "/v1/admin/users/ana/groups")
            #expect(anas.status == 200, "\(anas.text)")
            let found = anas.json["groups"] as? [[String: Any]] ?? []
            #expect(found.count == 1 && found.first?["groupId"] as? String == group, "\(anas.text)")
            #expect(found.first?["groupType"] as? String == "ORGANIZATION" && found.first?["environment"] as? String == "Sandbox")
            let roles = found.first?["roles"] as? [[String: String]] ?? []
            #expect(roles == [["productId": "com.example.vip.month", "role": "NONE"]], "\(anas.text)")
            let olgas = try await pipeline.admin(.GET, "/v1/admin/users/olga/groups")
            #expect(((olgas.json["groups"] as? [[String: Any]])?.first?["roles"] as? [[String: String]])?.first?["role"] == "ADMIN", "\(olgas.text)")

            // Two pages of two, then one: each member with the user it is known for.
            let first = try await pipeline.admin(.GET, "/v1/admin/groups/\(group)/members?limit=2")
            #expect(first.status == 200 && first.json["hasMore"] as? Bool == true, "\(first.text)")
            let token = try #require(first.json["paginationToken"] as? String)
            let encoded = try #require(token.addingPercentEncoding(withAllowedCharacters: .alphanumerics))
            // Without its environment, the sandbox's page token is asked of production first, which
            // does not know the group (a token of another group would be refused: 4000014).
            let rest = try await pipeline.admin(.GET, "/v1/admin/groups/\(group)/members?limit=2&paginationToken=\(encoded)")
            #expect(rest.status == 200 && rest.json["hasMore"] as? Bool == false && rest.json["paginationToken"] == nil, "\(rest.text)")
            let all = Self.members(first) + Self.members(rest)
            #expect(all.map(\.users) == [["olga"], ["ana"], ["ben"]], "\(first.text) \(rest.text)")
            #expect(Set(all.map(\.id)).count == 3)

            // The console shows the same: ana's page links to her groups, the group to its members.
            let signIn = try await EdgeSecurityTests.signIn(pipeline.intakeURL, token: PipelineHarness.viewerToken)
            let cookie = try #require(signIn.cookie, "\(signIn.text)")
            func console(_ path: String) async throws -> String {
                let page = try await EdgeSecurityTests.send(pipeline.intakeURL + path, headers: ["Cookie": cookie])
                #expect(page.status == 200, "\(path): \(page.text)")
                return page.text
            }
            #expect(try await console("/admin/users/ana").contains("href=\"/admin/users/ana/groups\""))
            let groupsPage = try await console("/admin/users/ana/groups")
            #expect(groupsPage.contains("href=\"/admin/groups/\(group)?environment=Sandbox\""), "\(groupsPage)")
            #expect(groupsPage.contains("com.example.vip.month: NONE"), "\(groupsPage)")
            let membersPage = try await console("/admin/groups/\(group)?environment=Sandbox")
            for user in ["olga", "ana", "ben"] {
                #expect(membersPage.contains("href=\"/admin/users/\(user)\""), "\(user): \(membersPage)")
            }
            #expect(try await console("/admin/groups/123456789").contains("Apple knows no group 123456789"))
            // A group larger than one page (50): the console links to the next members.
            let large = "7\(Int.random(in: 10_000_000...99_999_999))000000000"
            for seat in 0..<51 {
                let minted = try await HTTP.post(
                    pipeline.fakeURL + "/fake/purchases",
                    json: Mint(inAppOwnershipType: "ASSIGNED", quantity: 51, deviceId: "seat-\(seat)-\(large)", groupId: large))
                #expect(minted.status == 201, "\(minted.text)")
            }
            let firstPage = try await console("/admin/groups/\(large)?environment=Sandbox")
            let link = try #require(firstPage.range(of: "id=\"next-page\" href=\"").map { firstPage[$0.upperBound...].prefix { $0 != "\"" } })
            let secondPage = try await console(String(link).replacingOccurrences(of: "&amp;", with: "&"))
            #expect(secondPage.components(separatedBy: "<tr id=\"member-").count - 1 == 1, "\(secondPage)")
            #expect(!secondPage.contains("id=\"next-page\""))

            // The organization takes ben's seat back: his access ends, and he leaves the group.
            let revoke = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(bens)/refund", json: ["revocationType": "ASSIGNMENT_REVOKE"])
            #expect(revoke.status == 200, "\(revoke.text)")
            #expect(try await eventually(timeout: .seconds(30)) { try await pipeline.grantState(of: bens, user: "ben") == "revoked" })
            let afterwards = try await pipeline.admin(.GET, "/v1/admin/users/ben/groups")
            #expect((afterwards.json["groups"] as? [Any])?.isEmpty == true, "\(afterwards.text)")
            let left = try await pipeline.admin(.GET, "/v1/admin/groups/\(group)/members?environment=Sandbox")
            #expect(Self.members(left).map(\.users) == [["olga"], ["ana"]], "\(left.text)")

            // A group Apple does not know, and asks Apple would refuse.
            let unknown = try await pipeline.admin(.GET, "/v1/admin/groups/123456789/members")
            #expect(unknown.status == 404 && unknown.errorCode == "group_not_found", "\(unknown.text)")
            for bad in ["/v1/admin/groups/12ab/members", "/v1/admin/groups/\(group)/members?limit=0",
                "/v1/admin/groups/\(group)/members?environment=Xcode",
                "/v1/admin/groups/\(group)/members?environment=Sandbox&paginationToken=a%01b"]
            {
                let refused = try await pipeline.admin(.GET, bad)
                #expect(refused.status == 400 && refused.errorCode == "invalid_field", "\(bad): \(refused.text)")
            }
            let foreign = try await pipeline.admin(.GET, "/v1/admin/groups/\(group)/members?environment=Sandbox&paginationToken=bm90LWEtdG9rZW4")
            #expect(foreign.status == 409 && foreign.errorCode == "apple_refused" && foreign.text.contains("4000014"), "\(foreign.text)")
            // A user with no purchase is in no group.
            let nobody = try await pipeline.admin(.GET, "/v1/admin/users/nobody/groups")
            #expect(nobody.status == 200 && (nobody.json["groups"] as? [Any])?.isEmpty == true, "\(nobody.text)")
        }
    }
}
