#ifndef IAP_CRABBITMQ_SHIM_H
#define IAP_CRABBITMQ_SHIM_H

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <amqp_framing.h>

/*
 * amqp_login is C-variadic and does not import into Swift. This wrapper also announces the
 * client capability consumer_cancel_notify, without which the broker never tells a consumer
 * that it was cancelled (its queue deleted), and names the connection for the management UI.
 */
static inline amqp_rpc_reply_t iap_amqp_login_plain(amqp_connection_state_t state,
                                                    const char *vhost,
                                                    int channel_max,
                                                    int frame_max,
                                                    int heartbeat,
                                                    const char *user,
                                                    const char *password,
                                                    const char *connection_name) {
    amqp_table_entry_t capabilities[3];
    capabilities[0].key = amqp_cstring_bytes("consumer_cancel_notify");
    capabilities[0].value.kind = AMQP_FIELD_KIND_BOOLEAN;
    capabilities[0].value.value.boolean = 1;
    capabilities[1].key = amqp_cstring_bytes("publisher_confirms");
    capabilities[1].value.kind = AMQP_FIELD_KIND_BOOLEAN;
    capabilities[1].value.value.boolean = 1;
    capabilities[2].key = amqp_cstring_bytes("basic.nack");
    capabilities[2].value.kind = AMQP_FIELD_KIND_BOOLEAN;
    capabilities[2].value.value.boolean = 1;

    amqp_table_entry_t properties[2];
    properties[0].key = amqp_cstring_bytes("capabilities");
    properties[0].value.kind = AMQP_FIELD_KIND_TABLE;
    properties[0].value.value.table.num_entries = 3;
    properties[0].value.value.table.entries = capabilities;
    properties[1].key = amqp_cstring_bytes("connection_name");
    properties[1].value.kind = AMQP_FIELD_KIND_UTF8;
    properties[1].value.value.bytes = amqp_cstring_bytes(connection_name);

    amqp_table_t client_properties;
    client_properties.num_entries = 2;
    client_properties.entries = properties;
    return amqp_login_with_properties(state, vhost, channel_max, frame_max, heartbeat,
                                      &client_properties, AMQP_SASL_METHOD_PLAIN, user, password);
}

#endif
