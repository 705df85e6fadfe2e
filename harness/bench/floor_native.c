/*
 * The native floor: an ext_proc processor that answers exactly as harness/bench/floor.py does, in C, so that what it
 * costs is close to nothing and the rest of the Envoy + processor path is Envoy's ext_proc mechanism itself.
 *
 * gRPC over cleartext HTTP/2, server side only, one thread, Linux epoll, non-blocking sockets, libc only.
 * It never decodes HPACK: a stream's headers are not needed (every stream is taken to be an ext_proc Process call,
 * and a stream that sends no ext_proc request, such as the gateway's access-log Export calls, ends with
 * UNIMPLEMENTED as on the Python floor). Skipping header blocks is safe because only a decoder keeps HPACK state.
 *
 * Answers, by the ProcessingRequest's `request` oneof:
 *   request_headers                       the next of the --route answers, round robin
 *   response_headers                      the --response-headers answer
 *   request_trailers / response_trailers  the --request-trailers / --response-trailers answers
 *   request_body                          the same bytes streamed back (body_mutation.streamed_response), encoded here
 *   anything else                         nothing
 * The prebuilt answers are serialized ProcessingResponse messages in hex, made by harness/bench/floor_native.py.
 *
 *   floor_native --port 9102 [--host 127.0.0.1] --response-headers HEX --request-trailers HEX
 *                --response-trailers HEX --route HEX [--route HEX ...]
 *
 * Prints "ready" once listening; exits 0 on SIGTERM or SIGINT.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

/* HTTP/2 frame types and flags (RFC 9113 section 6) */
enum { DATA = 0, HEADERS = 1, PRIORITY = 2, RST_STREAM = 3, SETTINGS = 4, PUSH_PROMISE = 5, PING = 6, GOAWAY = 7,
       WINDOW_UPDATE = 8, CONTINUATION = 9 };
enum { END_STREAM = 0x1, ACK = 0x1, END_HEADERS = 0x4, PADDED = 0x8, PRIORITY_FLAG = 0x20 };
enum { SETTINGS_MAX_CONCURRENT_STREAMS = 3, SETTINGS_INITIAL_WINDOW_SIZE = 4, SETTINGS_MAX_FRAME_SIZE = 5 };
enum { REFUSED_STREAM = 7, ENHANCE_YOUR_CALM = 11 };

static const char PREFACE[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
#define PREFACE_LEN 24
#define FRAME_HEADER 9
#define MAX_FRAME 16384 /* we advertise no larger SETTINGS_MAX_FRAME_SIZE, so no peer frame is longer */
/* Our receive windows, stream and connection alike; a window is topped up once half of it has been used, so a
 * long-lived connection never stalls and WINDOW_UPDATEs stay rare (one per 512 KiB). */
#define RECV_WINDOW (1 << 20)
#define MAX_STREAMS 1024
/* What a peer can make us hold: one gRPC message, and a connection's unsent output (answers waiting for the
 * peer's flow-control window, which a peer that stops reading would grow without end). */
#define MAX_MESSAGE (16 << 20)
#define MAX_UNSENT (64 << 20)

/* HPACK blocks we send, none indexed into the dynamic table so that we keep no encoder state:
 * ":status: 200" is static index 8; content-type (static 31) and grpc-status are literals without indexing. */
static const unsigned char RESPONSE_HEADERS[] = {
    0x88, 0x0f, 0x10, 16, 'a', 'p', 'p', 'l', 'i', 'c', 'a', 't', 'i', 'o', 'n', '/', 'g', 'r', 'p', 'c'};
static const unsigned char TRAILERS_OK[] = {
    0x00, 11, 'g', 'r', 'p', 'c', '-', 's', 't', 'a', 't', 'u', 's', 1, '0'};
static const unsigned char TRAILERS_UNIMPLEMENTED[] = {
    0x00, 11, 'g', 'r', 'p', 'c', '-', 's', 't', 'a', 't', 'u', 's', 2, '1', '2'};

struct buf {
    unsigned char *data;
    size_t len, cap;
};

struct answer {
    unsigned char *data;
    size_t len;
};

struct stream {
    uint32_t id;
    int64_t send_window;   /* what the peer lets us send on this stream */
    uint32_t recv_unacked; /* bytes received since our last WINDOW_UPDATE for it */
    int answered;          /* response HEADERS sent */
    int peer_ended;        /* the peer sent END_STREAM: trailers go once `pending` is sent */
    struct buf message;    /* a gRPC message not yet whole */
    struct buf pending;    /* DATA payload waiting for flow-control window */
};

struct conn {
    int fd;
    int preface_seen;
    int writable_wait;     /* EPOLLOUT registered */
    struct buf in, out;
    uint32_t peer_max_frame;
    int64_t peer_initial_window;
    int64_t send_window;   /* connection-level window the peer gives us */
    uint32_t recv_unacked;
    uint32_t last_stream_id;
    uint32_t continuation; /* stream whose header block goes on in CONTINUATION frames, 0 when none */
    int continuation_ends; /* that HEADERS frame had END_STREAM */
    size_t unsent;         /* bytes in `pending` over all streams */
    struct stream **streams;
    size_t nstreams, cap_streams;
};

static struct answer *routes;
static size_t nroutes, next_route;
static struct answer response_headers_answer, request_trailers_answer, response_trailers_answer;
static int epfd;
static struct conn **conns; /* by file descriptor */
static size_t nconns;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void reserve(struct buf *b, size_t more) {
    if (b->len + more <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more)
        cap *= 2;
    b->data = realloc(b->data, cap);
    if (!b->data)
        die("realloc");
    b->cap = cap;
}

static void append(struct buf *b, const void *data, size_t len) {
    reserve(b, len);
    memcpy(b->data + b->len, data, len);
    b->len += len;
}

/* Drops the first `n` bytes. */
static void consume(struct buf *b, size_t n) {
    if (!n)
        return;
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
}

static void frame_header(struct buf *b, size_t len, int type, int flags, uint32_t stream_id) {
    unsigned char h[FRAME_HEADER] = {len >> 16, len >> 8, len, type, flags,
                                     (stream_id >> 24) & 0x7f, stream_id >> 16, stream_id >> 8, stream_id};
    append(b, h, sizeof h);
}

static void frame(struct buf *b, int type, int flags, uint32_t stream_id, const void *payload, size_t len) {
    frame_header(b, len, type, flags, stream_id);
    append(b, payload, len);
}

static void window_update(struct conn *c, uint32_t stream_id, uint32_t increment) {
    unsigned char p[4] = {increment >> 24, increment >> 16, increment >> 8, increment};
    frame(&c->out, WINDOW_UPDATE, 0, stream_id, p, 4);
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static struct stream *find_stream(struct conn *c, uint32_t id) {
    for (size_t i = 0; i < c->nstreams; i++)
        if (c->streams[i]->id == id)
            return c->streams[i];
    return NULL;
}

static void forget_stream(struct conn *c, struct stream *s) {
    for (size_t i = 0; i < c->nstreams; i++)
        if (c->streams[i] == s) {
            c->streams[i] = c->streams[--c->nstreams];
            break;
        }
    c->unsent -= s->pending.len;
    free(s->message.data);
    free(s->pending.data);
    free(s);
}

/* Sends what the windows allow of the stream's pending DATA; once all is sent and the peer has ended its side,
 * the trailers end the stream. Returns 1 when the stream is gone. */
static int flush_stream(struct conn *c, struct stream *s) {
    size_t sent = 0;
    while (sent < s->pending.len && c->send_window > 0 && s->send_window > 0) {
        size_t n = s->pending.len - sent;
        if (n > (size_t)c->send_window)
            n = c->send_window;
        if (n > (size_t)s->send_window)
            n = s->send_window;
        if (n > c->peer_max_frame)
            n = c->peer_max_frame;
        frame(&c->out, DATA, 0, s->id, s->pending.data + sent, n);
        c->send_window -= n;
        s->send_window -= n;
        sent += n;
    }
    consume(&s->pending, sent);
    c->unsent -= sent;
    if (s->pending.len || !s->peer_ended)
        return 0;
    if (s->answered)
        frame(&c->out, HEADERS, END_HEADERS | END_STREAM, s->id, TRAILERS_OK, sizeof TRAILERS_OK);
    else { /* trailers-only: no ext_proc request came, as on a call to another method */
        frame_header(&c->out, sizeof RESPONSE_HEADERS + sizeof TRAILERS_UNIMPLEMENTED, HEADERS,
                     END_HEADERS | END_STREAM, s->id);
        append(&c->out, RESPONSE_HEADERS, sizeof RESPONSE_HEADERS);
        append(&c->out, TRAILERS_UNIMPLEMENTED, sizeof TRAILERS_UNIMPLEMENTED);
    }
    forget_stream(c, s);
    return 1;
}

static void flush_all_streams(struct conn *c) {
    for (size_t i = 0; i < c->nstreams && c->send_window > 0;)
        if (!flush_stream(c, c->streams[i]))
            i++; /* a finished stream's slot now holds the last stream: look at it again */
}

/* The gRPC length prefix (uncompressed) of a message of `len` bytes. */
static void grpc_prefix(struct buf *b, size_t len) {
    unsigned char p[5] = {0, len >> 24, len >> 16, len >> 8, len};
    append(b, p, 5);
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static void put_varint(struct buf *b, uint64_t v) {
    while (v >= 0x80) {
        unsigned char byte = (v & 0x7f) | 0x80;
        append(b, &byte, 1);
        v >>= 7;
    }
    unsigned char byte = v;
    append(b, &byte, 1);
}

/* A length-delimited field's tag and length. */
static void put_field(struct buf *b, int field, size_t len) {
    put_varint(b, (uint64_t)field << 3 | 2);
    put_varint(b, len);
}

/* Reads a varint at *p (before end); 0 when it runs past the end or over 10 bytes. */
static int get_varint(const unsigned char **p, const unsigned char *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; *p < end && shift < 70; shift += 7) {
        unsigned char byte = *(*p)++;
        *v |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80))
            return 1;
    }
    return 0;
}

/* A length-delimited field of a message: its number and where its bytes are. */
struct field {
    int number;
    const unsigned char *data;
    size_t len;
};

/* Walks one message's fields: `last` gets the last length-delimited field numbered first_field..last_field, and
 * *varint_value the varint field numbered varint_field (0: none). Returns 0 on a malformed message. Fields come in
 * any order and may repeat (the last one wins, as in protobuf): nothing is assumed about which comes first. */

static int walk(const unsigned char *p, const unsigned char *end, struct field *last, int first_field,
                int last_field, int varint_field, uint64_t *varint_value) {
    while (p < end) {
        uint64_t tag, v;
        if (!get_varint(&p, end, &tag))
            return 0;
        int number = tag >> 3;
        if (!number)
            return 0;
        switch (tag & 7) {
        case 0:
            if (!get_varint(&p, end, &v))
                return 0;
            if (number == varint_field)
                *varint_value = v;
            break;
        case 1:
            if (end - p < 8)
                return 0;
            p += 8;
            break;
        case 2:
            if (!get_varint(&p, end, &v) || v > (uint64_t)(end - p))
                return 0;
            if (number >= first_field && number <= last_field) {
                last->number = number;
                last->data = p;
                last->len = v;
            }
            p += v;
            break;
        case 5:
            if (end - p < 4)
                return 0;
            p += 4;
            break;
        default: /* groups are not used by these messages */
            return 0;
        }
    }
    return 1;
}

/* ProcessingRequest field numbers of the `request` oneof, and HttpBody's (external_processor.proto) */
enum { REQUEST_HEADERS = 2, RESPONSE_HEADERS_FIELD = 3, REQUEST_BODY = 4, RESPONSE_BODY = 5, REQUEST_TRAILERS = 6,
       RESPONSE_TRAILERS = 7 };
enum { HTTP_BODY_BODY = 1, HTTP_BODY_END_OF_STREAM = 2 };

static void send_answer(struct conn *c, struct stream *s, const unsigned char *data, size_t len) {
    grpc_prefix(&s->pending, len);
    append(&s->pending, data, len);
    c->unsent += 5 + len;
}

/* ProcessingResponse{request_body: BodyResponse{response: CommonResponse{body_mutation: BodyMutation{
 * streamed_response: StreamedBodyResponse{body, end_of_stream}}}}}, fields 3/1/3/3/{1,2}; empty and false fields
 * left out, as protobuf serializes them. */
static void send_body_echo(struct conn *c, struct stream *s, const unsigned char *body, size_t body_len, int eos) {
    size_t streamed = (body_len ? 1 + varint_size(body_len) + body_len : 0) + (eos ? 2 : 0);
    size_t mutation = 1 + varint_size(streamed) + streamed;
    size_t common = 1 + varint_size(mutation) + mutation;
    size_t body_response = 1 + varint_size(common) + common;
    size_t total = 1 + varint_size(body_response) + body_response;
    size_t before = s->pending.len;
    reserve(&s->pending, 5 + total);
    grpc_prefix(&s->pending, total);
    put_field(&s->pending, 3, body_response); /* ProcessingResponse.request_body */
    put_field(&s->pending, 1, common);        /* BodyResponse.response */
    put_field(&s->pending, 3, mutation);      /* CommonResponse.body_mutation */
    put_field(&s->pending, 3, streamed);      /* BodyMutation.streamed_response */
    if (body_len) {
        put_field(&s->pending, 1, body_len); /* StreamedBodyResponse.body */
        append(&s->pending, body, body_len);
    }
    if (eos) {
        unsigned char end_of_stream[2] = {2 << 3 | 0, 1}; /* StreamedBodyResponse.end_of_stream = true */
        append(&s->pending, end_of_stream, 2);
    }
    c->unsent += s->pending.len - before;
}

/* One whole ProcessingRequest (the gRPC prefix stripped): queue its answer on the stream. */
static void on_message(struct conn *c, struct stream *s, const unsigned char *msg, size_t len) {
    struct field request = {0};
    if (!walk(msg, msg + len, &request, REQUEST_HEADERS, RESPONSE_TRAILERS, 0, NULL) || !request.number)
        return;
    const struct answer *a = NULL;
    switch (request.number) {
    case REQUEST_HEADERS:
        a = &routes[next_route];
        next_route = (next_route + 1) % nroutes;
        break;
    case RESPONSE_HEADERS_FIELD:
        a = &response_headers_answer;
        break;
    case REQUEST_TRAILERS:
        a = &request_trailers_answer;
        break;
    case RESPONSE_TRAILERS:
        a = &response_trailers_answer;
        break;
    case REQUEST_BODY:
        break;
    default: /* response_body: the floor asks for none, and answers none */
        return;
    }
    struct field body = {0};
    uint64_t eos = 0;
    if (!a && !walk(request.data, request.data + request.len, &body, HTTP_BODY_BODY, HTTP_BODY_BODY,
                    HTTP_BODY_END_OF_STREAM, &eos))
        return;
    if (!s->answered) {
        frame(&c->out, HEADERS, END_HEADERS, s->id, RESPONSE_HEADERS, sizeof RESPONSE_HEADERS);
        s->answered = 1;
    }
    if (a)
        send_answer(c, s, a->data, a->len);
    else
        send_body_echo(c, s, body.data, body.len, eos != 0);
}

static void close_conn(struct conn *c) {
    while (c->nstreams)
        forget_stream(c, c->streams[0]);
    close(c->fd); /* also leaves the epoll set */
    conns[c->fd] = NULL;
    free(c->streams);
    free(c->in.data);
    free(c->out.data);
    free(c);
}

/* A new stream, or NULL (refused) when the peer already has MAX_STREAMS open. */
static struct stream *open_stream(struct conn *c, uint32_t id) {
    c->last_stream_id = id;
    if (c->nstreams == MAX_STREAMS) {
        unsigned char code[4] = {0, 0, 0, REFUSED_STREAM};
        frame(&c->out, RST_STREAM, 0, id, code, 4);
        return NULL;
    }
    if (c->nstreams == c->cap_streams) {
        c->cap_streams = c->cap_streams ? 2 * c->cap_streams : 16;
        c->streams = realloc(c->streams, c->cap_streams * sizeof *c->streams);
        if (!c->streams)
            die("realloc");
    }
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        die("calloc");
    s->id = id;
    s->send_window = c->peer_initial_window;
    c->streams[c->nstreams++] = s;
    return s;
}

static void peer_ended(struct conn *c, uint32_t id) {
    struct stream *s = find_stream(c, id);
    if (s) {
        s->peer_ended = 1;
        flush_stream(c, s);
    }
}

/* Payload without its padding (PADDED flag); 0 when the padding is longer than the frame. */
static int unpad(int flags, const unsigned char **p, size_t *len) {
    if (!(flags & PADDED))
        return 1;
    if (*len < 1 || (*p)[0] >= *len)
        return 0;
    *len -= 1 + (*p)[0];
    (*p)++;
    return 1;
}

static int on_data(struct conn *c, int flags, uint32_t id, const unsigned char *p, size_t len) {
    /* Flow control counts the whole frame, padding included, whether or not the stream is still there. */
    c->recv_unacked += len;
    if (c->recv_unacked >= RECV_WINDOW / 2) {
        window_update(c, 0, c->recv_unacked);
        c->recv_unacked = 0;
    }
    if (!unpad(flags, &p, &len))
        return 0;
    struct stream *s = find_stream(c, id);
    if (!s)
        return 1; /* reset or refused: its data is dropped */
    s->recv_unacked += len;
    if (s->recv_unacked >= RECV_WINDOW / 2 && !(flags & END_STREAM)) {
        window_update(c, id, s->recv_unacked);
        s->recv_unacked = 0;
    }
    /* Whole messages are answered straight from the frame; only a message split over frames is copied. */
    if (s->message.len) {
        append(&s->message, p, len);
        p = s->message.data;
        len = s->message.len;
    }
    size_t used = 0;
    while (len - used >= 5) {
        size_t size = be32(p + used + 1);
        if (size > MAX_MESSAGE)
            return 0;
        if (len - used - 5 < size)
            break;
        if (p[used] == 0) /* a compressed message (flag 1) cannot be read: no answer */
            on_message(c, s, p + used + 5, size);
        used += 5 + size;
    }
    if (s->message.len)
        consume(&s->message, used);
    else
        append(&s->message, p + used, len - used);
    if (flags & END_STREAM)
        s->peer_ended = 1;
    flush_stream(c, s);
    return 1;
}

static int on_settings(struct conn *c, int flags, const unsigned char *p, size_t len) {
    if (flags & ACK)
        return 1;
    if (len % 6)
        return 0;
    for (size_t i = 0; i < len; i += 6) {
        int id = p[i] << 8 | p[i + 1];
        uint32_t value = be32(p + i + 2);
        if (id == SETTINGS_INITIAL_WINDOW_SIZE) { /* moves every open stream's window by the difference */
            for (size_t k = 0; k < c->nstreams; k++)
                c->streams[k]->send_window += (int64_t)value - c->peer_initial_window;
            c->peer_initial_window = value;
        } else if (id == SETTINGS_MAX_FRAME_SIZE)
            c->peer_max_frame = value;
    }
    frame(&c->out, SETTINGS, ACK, 0, NULL, 0);
    flush_all_streams(c);
    return 1;
}

/* One frame; returns 0 on a connection error (we then just close: the floor is a benchmark tool). */
static int on_frame(struct conn *c, int type, int flags, uint32_t id, const unsigned char *p, size_t len) {
    if (c->continuation && (type != CONTINUATION || id != c->continuation))
        return 0; /* a header block must go on uninterrupted */
    switch (type) {
    case DATA:
        return on_data(c, flags, id, p, len);
    case HEADERS:
        if (!id)
            return 0;
        if (id > c->last_stream_id) {
            if (!(id & 1))
                return 0;
            open_stream(c, id);
        }
        if (!(flags & END_HEADERS)) {
            c->continuation = id;
            c->continuation_ends = flags & END_STREAM;
        } else if (flags & END_STREAM)
            peer_ended(c, id);
        return 1;
    case CONTINUATION:
        if (!c->continuation)
            return 0;
        if (flags & END_HEADERS) {
            c->continuation = 0;
            if (c->continuation_ends)
                peer_ended(c, id);
        }
        return 1;
    case RST_STREAM: {
        struct stream *s = find_stream(c, id);
        if (s)
            forget_stream(c, s);
        return 1;
    }
    case SETTINGS:
        return on_settings(c, flags, p, len);
    case PING:
        if (len != 8)
            return 0;
        if (!(flags & ACK))
            frame(&c->out, PING, ACK, 0, p, 8);
        return 1;
    case GOAWAY:
    case PUSH_PROMISE: /* a client never sends one */
        return 0;
    case WINDOW_UPDATE: {
        if (len != 4)
            return 0;
        uint32_t increment = be32(p) & 0x7fffffff;
        if (!id) {
            c->send_window += increment;
            flush_all_streams(c);
        } else {
            struct stream *s = find_stream(c, id);
            if (s) {
                s->send_window += increment;
                flush_stream(c, s);
            }
        }
        return 1;
    }
    default: /* PRIORITY and unknown types */
        return 1;
    }
}

/* Every whole frame in the input; the rest waits for more bytes. */
static int on_input(struct conn *c) {
    size_t at = 0;
    if (!c->preface_seen) {
        if (c->in.len < PREFACE_LEN)
            return 1;
        if (memcmp(c->in.data, PREFACE, PREFACE_LEN))
            return 0;
        c->preface_seen = 1;
        at = PREFACE_LEN;
    }
    while (c->in.len - at >= FRAME_HEADER) {
        const unsigned char *h = c->in.data + at;
        size_t len = (size_t)h[0] << 16 | h[1] << 8 | h[2];
        if (len > MAX_FRAME)
            return 0;
        if (c->in.len - at - FRAME_HEADER < len)
            break;
        if (!on_frame(c, h[3], h[4], be32(h + 5) & 0x7fffffff, h + FRAME_HEADER, len))
            return 0;
        at += FRAME_HEADER + len;
    }
    consume(&c->in, at);
    return c->unsent <= MAX_UNSENT;
}

static void watch_writable(struct conn *c, int on) {
    if (c->writable_wait == on)
        return;
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.fd = c->fd};
    if (epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev))
        die("epoll_ctl");
    c->writable_wait = on;
}

/* Writes what the socket takes; the rest waits for EPOLLOUT. Returns 0 when the connection is gone. */
static int write_out(struct conn *c) {
    size_t sent = 0;
    while (sent < c->out.len) {
        ssize_t n = send(c->fd, c->out.data + sent, c->out.len - sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                break;
            return 0;
        }
        sent += n;
    }
    consume(&c->out, sent);
    watch_writable(c, c->out.len > 0);
    return 1;
}

static int read_in(struct conn *c) {
    for (;;) {
        reserve(&c->in, 256 * 1024);
        size_t room = c->in.cap - c->in.len;
        ssize_t n = recv(c->fd, c->in.data + c->in.len, room, 0);
        if (n < 0)
            return errno == EAGAIN || errno == EINTR;
        if (n == 0)
            return 0;
        c->in.len += n;
        if ((size_t)n < room) /* the socket is drained: no second call to learn EAGAIN */
            return 1;
    }
}

static void on_readable(struct conn *c) {
    if (!read_in(c) || !on_input(c) || !write_out(c))
        close_conn(c);
}

static void put_setting(unsigned char *p, int id, uint32_t value) {
    p[0] = id >> 8;
    p[1] = id;
    p[2] = value >> 24;
    p[3] = value >> 16;
    p[4] = value >> 8;
    p[5] = value;
}

static void accept_all(int listener) {
    for (;;) {
        int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)
                return;
            die("accept4");
        }
        int one = 1; /* answers are small and latency is the point: no Nagle delay */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if ((size_t)fd >= nconns) {
            size_t n = nconns ? nconns : 64;
            while (n <= (size_t)fd)
                n *= 2;
            conns = realloc(conns, n * sizeof *conns);
            if (!conns)
                die("realloc");
            memset(conns + nconns, 0, (n - nconns) * sizeof *conns);
            nconns = n;
        }
        struct conn *c = calloc(1, sizeof *c);
        if (!c)
            die("calloc");
        c->fd = fd;
        c->peer_max_frame = MAX_FRAME;
        c->peer_initial_window = 65535;
        c->send_window = 65535;
        conns[fd] = c;
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev))
            die("epoll_ctl");
        /* Our SETTINGS, then the connection window raised from the default 65535 to RECV_WINDOW. */
        unsigned char settings[12];
        put_setting(settings, SETTINGS_MAX_CONCURRENT_STREAMS, MAX_STREAMS);
        put_setting(settings + 6, SETTINGS_INITIAL_WINDOW_SIZE, RECV_WINDOW);
        frame(&c->out, SETTINGS, 0, 0, settings, sizeof settings);
        window_update(c, 0, RECV_WINDOW - 65535);
        if (!write_out(c))
            close_conn(c);
    }
}

static int hex_value(int ch) {
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static struct answer from_hex(const char *hex) {
    size_t n = strlen(hex);
    struct answer a = {malloc(n / 2 + 1), n / 2};
    if (!a.data)
        die("malloc");
    for (size_t i = 0; i < a.len; i++) {
        int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
        if (n % 2 || hi < 0 || lo < 0) {
            fprintf(stderr, "not hex: %s\n", hex);
            exit(2);
        }
        a.data[i] = hi << 4 | lo;
    }
    return a;
}

static void usage(void) {
    fprintf(stderr, "usage: floor_native --port PORT [--host ADDRESS] --response-headers HEX --request-trailers HEX "
                    "--response-trailers HEX --route HEX [--route HEX ...]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    int port = 0;
    routes = calloc(argc, sizeof *routes);
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 == argc)
            usage();
        const char *name = argv[i], *value = argv[i + 1];
        if (!strcmp(name, "--port"))
            port = atoi(value);
        else if (!strcmp(name, "--host"))
            host = value;
        else if (!strcmp(name, "--route"))
            routes[nroutes++] = from_hex(value);
        else if (!strcmp(name, "--response-headers"))
            response_headers_answer = from_hex(value);
        else if (!strcmp(name, "--request-trailers"))
            request_trailers_answer = from_hex(value);
        else if (!strcmp(name, "--response-trailers"))
            response_trailers_answer = from_hex(value);
        else
            usage();
    }
    if (port <= 0 || !nroutes || !response_headers_answer.data || !request_trailers_answer.data ||
        !response_trailers_answer.data)
        usage();

    /* SIGTERM and SIGINT arrive as a readable descriptor, so the loop sees them without races. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    if (sigprocmask(SIG_BLOCK, &stop, NULL))
        die("sigprocmask");
    int sigfd = signalfd(-1, &stop, SFD_CLOEXEC);
    if (sigfd < 0)
        die("signalfd");

    int listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listener < 0)
        die("socket");
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1)
        usage();
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1024))
        die("bind/listen");

    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = listener};
    struct epoll_event sev = {.events = EPOLLIN, .data.fd = sigfd};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, listener, &ev) || epoll_ctl(epfd, EPOLL_CTL_ADD, sigfd, &sev))
        die("epoll_ctl");
    printf("ready\n");
    fflush(stdout);

    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(epfd, events, 64, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == sigfd)
                return 0;
            if (fd == listener) {
                accept_all(listener);
                continue;
            }
            struct conn *c = conns[fd];
            if (!c) /* closed earlier in this batch */
                continue;
            if (events[i].events & (EPOLLERR | EPOLLHUP))
                close_conn(c);
            else if (events[i].events & EPOLLIN)
                on_readable(c);
            else if (!write_out(c))
                close_conn(c);
        }
    }
}
