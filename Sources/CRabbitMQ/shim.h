#ifndef IAP_CRABBITMQ_SHIM_H
#define IAP_CRABBITMQ_SHIM_H

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <amqp_framing.h>

/* amqp_login is C-variadic and does not import into Swift. */
static inline amqp_rpc_reply_t iap_amqp_login_plain(amqp_connection_state_t state,
                                                    const char *vhost,
                                                    int channel_max,
                                                    int frame_max,
                                                    int heartbeat,
                                                    const char *user,
                                                    const char *password) {
    return amqp_login(state, vhost, channel_max, frame_max, heartbeat,
                      AMQP_SASL_METHOD_PLAIN, user, password);
}

#endif
