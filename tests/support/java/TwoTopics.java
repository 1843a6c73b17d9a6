// A Java producer and consumer on two topics, one of which the client may not use, for
// the integration tests; run with Java's single-file source launcher on the Kafka jars'
// classpath:
//
//     java -cp 'libs/*' TwoTopics.java <bootstrap> <client id> <group> <allowed> <denied> <n>
//
// Produces n records to each topic from one producer (its batches for both go to the
// one broker in one Produce request), printing "sent <topic> <ok|exception class>" per
// record; then a consumer of the group subscribed to both polls until it has read the
// allowed topic's records (and no more than 60 s), printing "read <topic> <value>" per
// record and "denied <exception class> <topics>" per error poll() raises (and until
// poll() has raised one).
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.Future;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.errors.TopicAuthorizationException;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

public class TwoTopics {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], clientId = args[1], group = args[2];
        String allowed = args[3], denied = args[4];
        int n = Integer.parseInt(args[5]);
        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("client.id", clientId);
        props.put("linger.ms", "200");  // one request for both topics' batches
        props.put("enable.idempotence", "false");
        props.put("retries", "0");
        props.put("max.block.ms", "20000");
        props.put("delivery.timeout.ms", "20000");
        props.put("request.timeout.ms", "15000");
        List<Future<RecordMetadata>> sent = new ArrayList<>();
        List<String> topics = new ArrayList<>();
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(
                props, new StringSerializer(), new StringSerializer())) {
            for (int i = 0; i < n; i++) {
                for (String topic : List.of(allowed, denied)) {
                    sent.add(producer.send(new ProducerRecord<>(topic, "java-" + i)));
                    topics.add(topic);
                }
            }
            producer.flush();
        }
        for (int i = 0; i < sent.size(); i++) {
            String outcome = "ok";
            try {
                sent.get(i).get();
            } catch (java.util.concurrent.ExecutionException e) {
                outcome = e.getCause().getClass().getSimpleName();
            }
            System.out.println("sent " + topics.get(i) + " " + outcome);
        }
        Properties cprops = new Properties();
        cprops.put("bootstrap.servers", bootstrap);
        cprops.put("client.id", clientId);
        cprops.put("group.id", group);
        cprops.put("auto.offset.reset", "earliest");
        cprops.put("enable.auto.commit", "false");
        int read = 0;
        boolean refused = false;
        long until = System.currentTimeMillis() + 60_000;
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(
                cprops, new StringDeserializer(), new StringDeserializer())) {
            consumer.subscribe(List.of(allowed, denied));
            while ((read < n || !refused) && System.currentTimeMillis() < until) {
                try {
                    for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(500))) {
                        System.out.println("read " + record.topic() + " " + record.value());
                        if (record.topic().equals(allowed)) {
                            read++;
                        }
                    }
                } catch (TopicAuthorizationException e) {
                    refused = true;
                    System.out.println("denied " + e.getClass().getSimpleName() + " "
                                       + e.unauthorizedTopics());
                }
            }
        }
        System.out.flush();
    }
}
